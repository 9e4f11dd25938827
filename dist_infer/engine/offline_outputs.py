"""Offline generation's outputs, and how every rank of a library call gets the driver's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from dist_infer.comm.base import Communicator


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: Optional[str] = None
    logits: list[torch.Tensor] = field(default_factory=list)  # per step, when asked for
    num_preemptions: int = 0


def share_outputs(
    world: Communicator,
    vocab_size: int,
    outputs: Optional[list[GenerationOutput]],
    prompts: list[list[int]],
    return_logits: bool,
) -> list[GenerationOutput]:
    """The driver's outputs to every rank (so each rank of a library call gets the answer)."""
    if world.size == 1:
        return outputs
    n = len(prompts)
    reasons = ("stop", "length", "abort")
    if outputs is not None:
        ints = [n] + [x for o in outputs for x in (len(o.token_ids), reasons.index(o.finish_reason or "abort"))]
        ints += [t for o in outputs for t in o.token_ids]
        head = torch.tensor([len(ints)], dtype=torch.long)
    else:
        head = torch.empty(1, dtype=torch.long)
    world.broadcast(head, 0)
    payload = (
        torch.tensor(ints, dtype=torch.long) if outputs is not None else torch.empty(int(head[0]), dtype=torch.long)
    )
    world.broadcast(payload, 0)
    v = payload.tolist()
    lens = v[1 : 1 + 2 * n : 2]
    total = sum(lens)
    lp = (
        torch.tensor([x for o in outputs for x in o.logprobs], dtype=torch.float64)
        if outputs is not None
        else torch.empty(total, dtype=torch.float64)
    )
    if total:
        world.broadcast(lp, 0)
    logits = None
    if return_logits and total:
        logits = (
            torch.cat([torch.stack(o.logits) for o in outputs if o.logits]).float()
            if outputs is not None
            else torch.empty(total, vocab_size, dtype=torch.float32)
        )
        world.broadcast(logits, 0)
    if outputs is not None:
        return outputs
    result, at = [], 1 + 2 * n
    flat = 0
    for i in range(n):
        k, reason = v[1 + 2 * i], reasons[v[2 + 2 * i]]
        ids = v[at : at + k]
        at += k
        out = GenerationOutput(list(prompts[i]), ids, lp[flat : flat + k].tolist(), reason)
        if logits is not None:
            out.logits = list(logits[flat : flat + k])
        flat += k
        result.append(out)
    return result
