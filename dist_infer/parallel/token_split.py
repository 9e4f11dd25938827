"""Token-splitting compute-communication overlap for tensor-parallel decoder layers (TokenWeave).

The step's tokens are cut into two halves, A and B. Each row-parallel projection ends in an
all-reduce; instead of waiting for it, the layer posts it asynchronously and computes the other
half meanwhile:

    attn(A) -> post AR(A)      [AR of the previous layer's MLP(B) completes here]
    attn(B) -> post AR(B)      while AR(A) flies
    wait AR(A); residual+norm; mlp(A) -> post AR(A)     while AR(B) flies
    wait AR(B); residual+norm; mlp(B) -> post AR(B)     while AR(A) flies
    wait AR(A); residual       ... AR(B) is carried into the next layer, behind its attn(A)

so every collective has a half's worth of computation to hide behind, and the residual add and
RMSNorm after each reduce run while the other half's reduce is in flight.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from dist_infer.comm.base import Communicator, Handle
from dist_infer.parallel.overlap_policy import should_split  # noqa: F401 (the engine imports it from here)


class SplitLayerOps(Protocol):
    """The pieces of decoder layer `i` the schedule interleaves (LlamaStage provides them)."""

    def attn(self, i: int, x: torch.Tensor, half: int) -> torch.Tensor:
        """Norm + attention of `half` up to o_proj's un-reduced partial sum."""

    def attn_done(self, i: int, y: torch.Tensor) -> torch.Tensor:
        """What follows o_proj's all-reduce (its bias)."""

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Norm + MLP up to down_proj's un-reduced partial sum."""

    def mlp_done(self, i: int, y: torch.Tensor) -> torch.Tensor:
        """What follows down_proj's all-reduce (its bias)."""


class InFlight:
    """A partial sum whose all-reduce has been posted."""

    def __init__(self, tp: Communicator, partial: torch.Tensor, finish: Callable[[torch.Tensor], torch.Tensor]):
        self.partial, self.finish = partial, finish
        self.handle: Optional[Handle] = tp.all_reduce(partial, async_op=True)

    def result(self) -> torch.Tensor:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        return self.finish(self.partial)


def run_layers_token_split(
    num_layers: int, x_a: torch.Tensor, x_b: torch.Tensor, tp: Communicator, ops: SplitLayerOps
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run layers 0..num_layers-1 over the two halves, every all-reduce overlapped; returns both residuals."""
    carried_b: Optional[InFlight] = None
    for i in range(num_layers):
        attn_a = InFlight(tp, ops.attn(i, x_a, 0), lambda y, i=i: ops.attn_done(i, y))
        if carried_b is not None:
            x_b = x_b + carried_b.result()
        attn_b = InFlight(tp, ops.attn(i, x_b, 1), lambda y, i=i: ops.attn_done(i, y))
        x_a = x_a + attn_a.result()
        mlp_a = InFlight(tp, ops.mlp(i, x_a), lambda y, i=i: ops.mlp_done(i, y))
        x_b = x_b + attn_b.result()
        carried_b = InFlight(tp, ops.mlp(i, x_b), lambda y, i=i: ops.mlp_done(i, y))
        x_a = x_a + mlp_a.result()
    if carried_b is not None:
        x_b = x_b + carried_b.result()
    return x_a, x_b
