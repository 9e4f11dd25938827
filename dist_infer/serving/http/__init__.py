"""The front end's HTTP side: the OpenAI-compatible API (FastAPI on uvicorn), what guards it, the request
bodies and their translation, the clients' streams, detokenizing and the Prometheus metrics. It reaches the
instances only through the fleet's interface (`dist_infer.serving.fleet`)."""
