"""Serving: the OpenAI-compatible HTTP API, the model instances behind it (which die, restart,
stop and join while the others serve on), and live request migration between them (load
balancing, draining, and the prefill -> decode hand-over)."""
