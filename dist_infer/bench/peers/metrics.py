"""The metrics dict every peer reports (the keys are listed in the package docstring)."""

from __future__ import annotations

import sys
from typing import Any, Optional

from dist_infer.models.checkpoint import peak_rss_mb


def empty_metrics(peer: str, tp: int = 1, error: Optional[str] = None) -> dict[str, Any]:
    """The metrics dict with every key of the convention present; ok False until filled in."""
    return {
        "peer": peer,
        "prefill_tok_s": None,
        "decode_tok_s": None,
        "ttft_s": None,
        "tpot_s": None,
        "peak_rss_mb": None,
        "tp": tp,
        "ok": False,
        "error": error,
    }


def failed(peer: str, error: str, tp: int = 1, **extra: Any) -> dict[str, Any]:
    out = empty_metrics(peer, tp, error)
    out.update(extra)
    return out


def versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "transformers", "deepspeed"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = getattr(mod, "__version__", "?")
    return out


def finished(
    peer: str,
    tp: int,
    threads: int,
    load_s: float,
    timing: dict,
    batch: int,
    prompt_len: int,
    gen_len: int,
    world_size: int,
) -> dict[str, Any]:
    rss = peak_rss_mb()
    rss_max, rss_total = rss, rss
    if world_size > 1:
        import torch
        import torch.distributed as dist

        t = torch.tensor([rss, rss], dtype=torch.float64)
        mx = t[:1].clone()
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        tot = t[1:].clone()
        dist.all_reduce(tot, op=dist.ReduceOp.SUM)
        rss_max, rss_total = float(mx.item()), float(tot.item())
    out = empty_metrics(peer, tp)
    out.update(timing)
    out.update(
        ok=True,
        error=None,
        peak_rss_mb=rss_max,  # the largest rank's peak
        peak_rss_mb_total=rss_total,  # summed over the ranks
        load_s=load_s,
        threads=threads,
        batch=batch,
        prompt_len=prompt_len,
        gen_len=gen_len,
        world_size=world_size,
        versions=versions(),
    )
    return out
