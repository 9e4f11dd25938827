"""The routed experts one rank holds: the SwiGLU experts its ep rank owns, each split over tp,
with their weight loaders and the grouped forward over the rows it received.

Split from the layer because holding and loading expert weights (HF per-expert or fused
tensors, sliced to this rank) is a different job from routing rows between ranks.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dist_infer.comm.base import Communicator
from dist_infer.parallel.moe.placement import ExpertPlacement
from dist_infer.parallel.quantized_linear import QuantizedShard
from dist_infer.parallel.sharding import shard_range
from dist_infer.parallel.weights import check_shape, copy_into


class ParallelExperts(nn.Module):
    """The SwiGLU experts this rank owns, each with its intermediate dimension split over tp.

    Weights are stacked per local expert: w13 [E_local, 2 * I/tp, H] (gate rows, then up rows)
    and w2 [E_local, H, I/tp]. Loaders take the full HF tensor of one expert, or HF's fused
    3-D tensors, and read only this rank's slice of it.
    """

    def __init__(
        self,
        placement: ExpertPlacement,
        ep_rank: int,
        hidden: int,
        intermediate: int,
        tp: Communicator,
        dtype: torch.dtype,
        name: str,
    ):
        super().__init__()
        self.name, self.hidden, self.intermediate = name, hidden, intermediate
        self.experts = placement.local_experts(ep_rank)
        self.local_index = {e: j for j, e in enumerate(self.experts)}
        self.i_start, self.i_local = shard_range(intermediate, tp.size, tp.rank, f"{name}: expert intermediate size")
        n = len(self.experts)
        # the stacked float weights (None once set_quantization packs them instead)
        self.w13: Optional[nn.Parameter] = nn.Parameter(
            torch.empty(n, 2 * self.i_local, hidden, dtype=dtype), requires_grad=False
        )
        self.w2: Optional[nn.Parameter] = nn.Parameter(
            torch.empty(n, hidden, self.i_local, dtype=dtype), requires_grad=False
        )
        self.scheme = "none"
        self.packed13, self.packed2 = nn.ModuleDict(), nn.ModuleDict()  # per local expert, when quantized
        self._shards: dict[tuple[int, str], QuantizedShard] = {}
        self.kernels = None  # the native CPU kernels (use_native_kernels), for the quantized experts

    def set_quantization(self, scheme: str) -> None:
        """Hold each expert's weights packed for the quantized kernels (see parallel/quantized_linear.py);
        the stacked float weights are dropped before loading."""
        if scheme == "none":
            return
        if self.w13 is None:
            raise ValueError(f"{self.name}: the experts are quantized already ({self.scheme})")
        dtype = self.w13.dtype
        self.scheme, self.w13, self.w2 = scheme, None, None
        for j, e in enumerate(self.experts):
            self._shards[j, "13"] = QuantizedShard(scheme, dtype, f"{self.name}.{e}.gate_up", parts=2)
            self._shards[j, "2"] = QuantizedShard(scheme, dtype, f"{self.name}.{e}.down", parts=1)

    def _load_packed(self, j: int, which: str, source, rows: slice, cols: slice, offset: int, label: str) -> None:
        packed = self._shards[j, which].add(source, rows, cols, offset, label, native=self.kernels is not None)
        if packed is not None:
            del self._shards[j, which]
            (self.packed13 if which == "13" else self.packed2)[str(j)] = packed

    def _gate_up_down(self, j: int):
        """Expert j's two products x -> [gate | up] and h -> down."""
        w13, w2 = self.w13, self.w2
        if w13 is not None and w2 is not None:  # (float weights: both, or neither once quantized)
            return (lambda x: F.linear(x, w13[j])), (lambda h: F.linear(h, w2[j]))
        gate_up, down = self.packed13[str(j)], self.packed2[str(j)]
        return (lambda x: gate_up(x, self.kernels)), (lambda h: down(h, self.kernels))

    def _rows(self, source, rows: int, expert: Optional[int] = None) -> torch.Tensor:
        """This rank's intermediate rows of a [I, H] source (or of expert `expert` of an [E, I', H] one)."""
        index = (slice(self.i_start + rows, self.i_start + rows + self.i_local), slice(None))
        if expert is None:
            return source[index]
        return source[(slice(expert, expert + 1),) + index][0]

    def load_expert(self, expert: int, gate, up, down) -> None:
        """One expert from its own tensors: gate/up [I, H] (Mixtral w1/w3), down [H, I] (w2)."""
        j, I, H = self.local_index[expert], self.intermediate, self.hidden
        rows, cols = slice(self.i_start, self.i_start + self.i_local), slice(self.i_start, self.i_start + self.i_local)
        for part, source in enumerate((gate, up)):
            label = f"{self.name}.{expert}.{'gate' if part == 0 else 'up'}"
            check_shape(label, source, (I, H))
            if self.w13 is None:
                self._load_packed(j, "13", source, rows, slice(None), part * self.i_local, label)
            else:
                copy_into(self.w13[j, part * self.i_local : (part + 1) * self.i_local], self._rows(source, 0), label)
        check_shape(f"{self.name}.{expert}.down", down, (H, I))
        if self.w2 is None:
            self._load_packed(j, "2", down, slice(None), cols, 0, f"{self.name}.{expert}.down")
        else:
            copy_into(self.w2[j], down[:, cols], f"{self.name}.{expert}.down")

    def load_fused(self, gate_up, down, num_experts: int) -> None:
        """From transformers' fused tensors: gate_up [E, 2I, H] (gate rows first), down [E, H, I]."""
        I, H = self.intermediate, self.hidden
        check_shape(f"{self.name}.gate_up_proj", gate_up, (num_experts, 2 * I, H))
        check_shape(f"{self.name}.down_proj", down, (num_experts, H, I))
        for j, e in enumerate(self.experts):
            if self.w13 is None or self.w2 is None:  # quantized: the fused tensors' slices of expert e, as floats
                for part in (0, 1):
                    self._load_packed(
                        j,
                        "13",
                        self._rows(gate_up, part * I, e),
                        slice(None),
                        slice(None),
                        part * self.i_local,
                        f"{self.name}.gate_up_proj[{e}]",
                    )
                self._load_packed(
                    j,
                    "2",
                    down[e : e + 1, :, self.i_start : self.i_start + self.i_local][0],
                    slice(None),
                    slice(None),
                    0,
                    f"{self.name}.down_proj[{e}]",
                )
                continue
            for part in (0, 1):
                copy_into(
                    self.w13[j, part * self.i_local : (part + 1) * self.i_local],
                    self._rows(gate_up, part * I, e),
                    f"{self.name}.gate_up_proj[{e}]",
                )
            down_rows = down[e : e + 1, :, self.i_start : self.i_start + self.i_local][0]
            copy_into(self.w2[j], down_rows, f"{self.name}.down_proj[{e}]")

    def forward(self, rows: torch.Tensor, local_ids: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Expert `local_ids[i]` applied to `rows[i]`; un-reduced over tp. `sizes`: rows per local
        expert, which the caller knows on the host (counting them here would read the device)."""
        order = torch.argsort(local_ids, stable=True)
        grouped = rows[order]
        out = torch.empty_like(grouped)
        start = 0
        for j, n in enumerate(sizes):
            if n:
                gate_up, down = self._gate_up_down(j)
                gate, up = gate_up(grouped[start : start + n]).chunk(2, dim=-1)
                out[start : start + n] = down(F.silu(gate) * up)
            start += n
        result = torch.empty_like(out)
        result[order] = out
        return result
