"""Serving: the OpenAI-compatible HTTP API, the model instances behind it (which die, restart,
stop and join while the others serve on), and live request migration between them (load
balancing, draining, and the prefill -> decode hand-over). The server's processes start here too:
each instance as a job of its own, or the API beside a launched job (`spawn`), and an instance's
side of joining the API's hub (`join`)."""
