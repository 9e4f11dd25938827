"""The timed runs: a warm-up, then the best of `repeat` generations of the workload."""

from __future__ import annotations

from typing import Optional


def measure(engine, prompts, gen_len: int, repeat: int, progress, comms: Optional[dict] = None) -> dict:
    """The best of `repeat` timed runs, with the least of their median decode steps ("tpot_median_s");
    with `comms` (axis -> MeasuredCommunicator), also the seconds each group's communication kept this
    rank waiting in that run ("exposed_s": axis -> op -> s)."""
    comms = comms or {}
    from dist_infer.engine.sampling import SamplingParams

    engine.generate([p[:16] for p in prompts], SamplingParams(max_new_tokens=3, stop_at_eos=False))  # warm-up
    if hasattr(engine.stage, "reset_routing_stats"):
        engine.stage.reset_routing_stats()  # MoE routing statistics of the timed runs only
    best = median_step = None
    for _ in range(repeat):
        for c in comms.values():
            c.reset()
        engine.generate(prompts, SamplingParams(max_new_tokens=gen_len, stop_at_eos=False))
        t = engine.timing.as_dict()
        if comms:
            t["exposed_s"] = {axis: c.reset() for axis, c in comms.items() if c.size > 1}
        if best is None or t["ttft_s"] + t["tpot_s"] * gen_len < best["ttft_s"] + best["tpot_s"] * gen_len:
            best = t
        median_step = min(median_step, t["tpot_median_s"]) if median_step is not None else t["tpot_median_s"]
        progress()
    return {**best, "tpot_median_s": median_step}
