"""Serving: the OpenAI-compatible HTTP API in front of the engine, and the bridge between them."""
