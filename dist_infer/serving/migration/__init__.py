"""Moving live requests between instances: one migration's protocol (reserve, copy in stages, pause,
commit), its bookkeeping in the front end, and the rebalancing policy that picks what moves where."""
