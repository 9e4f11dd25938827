"""Expert parallelism for mixture-of-experts layers, one concept per module:

- `routing`: the pure routing math (top-k router, token chunks per ep rank, dispatch order);
- `placement`: which ep rank owns each expert, load imbalance, balanced placements (pure);
- `routing_file`: the JSON routing file (measured counts and placement), written and read;
- `stats`: per-layer routing statistics and phase timings;
- `experts`: the SwiGLU experts one rank holds, their weight loaders and grouped forward;
- `layer`: `ExpertParallelMoE`, the all-to-all dispatch / combine layer over the ep group.

The public names are re-exported here; code inside the repo imports from the modules.
"""

from dist_infer.parallel.moe.experts import ParallelExperts
from dist_infer.parallel.moe.layer import ExpertParallelMoE
from dist_infer.parallel.moe.placement import ExpertPlacement, balanced_placement, imbalance
from dist_infer.parallel.moe.routing import dispatch_order, token_chunk, topk_routing
from dist_infer.parallel.moe.routing_file import ROUTING_FILE_KIND, read_placement_file, write_routing_file
from dist_infer.parallel.moe.stats import PHASES, RoutingStats

__all__ = [
    "PHASES",
    "ROUTING_FILE_KIND",
    "ExpertParallelMoE",
    "ExpertPlacement",
    "ParallelExperts",
    "RoutingStats",
    "balanced_placement",
    "dispatch_order",
    "imbalance",
    "read_placement_file",
    "token_chunk",
    "topk_routing",
    "write_routing_file",
]
