"""Serving: the OpenAI-compatible HTTP API, the model instances behind it, and live request
migration between them."""
