"""Driving an engine's step loop in a test: requests arriving at given steps."""

from __future__ import annotations


def serve_stream(engine, prompts, params, arrivals, max_steps: int = 3000) -> list:
    """Add prompt i at step arrivals[i] (params: one for all, or one per prompt) and step until
    everything finished; returns the requests in prompt order."""
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    requests, step = {}, 0
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            requests[i] = engine.add_request(f"q{i}", prompts[i], params[i] if isinstance(params, list) else params)
        engine.step()
        step += 1
        assert step < max_steps, "the stream did not finish"
    return [requests[i] for i in range(len(prompts))]
