"""Where a step's tensors cross between the host and the model's device: the only two places.

The engine builds a step's inputs (token ids, attention metadata, block indices) on the host from
the plan's lists and moves them to the model's device once, with `to_device`; the results the
host needs (sampled ids and logprobs for the API, logits when asked for) come back once, with
`to_host`. Everything between stays on the device. On a CPU model both are no-ops, so a CPU run
is exactly what it was.

On CUDA the host side goes through pinned (page-locked) memory, and only there: a host -> device
copy from pinned memory does not block the host (torch's caching host allocator keeps the staging
buffer until the copy has run), and a device -> host copy into pinned memory is the fastest way
for the host to wait for values it needs at once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from dist_infer.engine.sampling import SampledTokens


def module_device(module: torch.nn.Module) -> torch.device:
    """Where a model stage lives: its first parameter's device (the CPU for a stage without any)."""
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`: `t` itself where it is already there; to CUDA through pinned memory."""
    if t.device == device or (device.type == "cpu" and t.device.type == "cpu"):
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def host_index(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 index built from host values, on `device` (a CPU index into a device tensor is a
    hidden copy and synchronisation)."""
    return to_device(torch.tensor(values, dtype=torch.long), device)


def to_host(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`t`'s values on the host: `t` itself on the CPU; from CUDA into a pinned buffer (this waits)."""
    if t is None or t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    host.copy_(t)
    return host


def sampled_to_host(sampled: SampledTokens) -> SampledTokens:
    """A step's sampled rows where the driver reads them (the sampler leaves them on the logits' device)."""
    if sampled.tokens.device.type == "cpu":
        return sampled
    return replace(sampled, tokens=to_host(sampled.tokens), logprobs=to_host(sampled.logprobs),
                   top_ids=to_host(sampled.top_ids), top_logprobs=to_host(sampled.top_logprobs),
                   logits=to_host(sampled.logits))
