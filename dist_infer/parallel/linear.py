"""Tensor-parallel linear layers. Each owns only its shard, sized at construction, and loads
it from the full checkpoint tensor with a weight loader (vLLM's pattern).

Column-parallel splits output features (no communication in); row-parallel splits input
features and ends with an all-reduce over the tp group.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dist_infer.comm.base import Communicator
from dist_infer.kernels import MAX_ROWS, CpuKernels, kernels_if_cpu_fp32
from dist_infer.parallel.quantized_linear import FloatLinear, QuantizedShard
from dist_infer.parallel.sharding import HeadLayout, shard_range
from dist_infer.parallel.tp_comm import reduce_from_tp
from dist_infer.parallel.weights import check_shape, copy_into, narrow


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, kernels: Optional[CpuKernels] = None
) -> torch.Tensor:
    """x W^T on the CPU: for the few rows of a decode step, by the kernel that streams W fastest;
    for more, through the native kernels' GEMM (kernels/gemm.py: oneDNN's where it loads).

    Decode reads every weight once per step, so its GEMMs are bound by how fast W streams.
    On the CPU the native kernel (kernels/cpu_kernels.c) walks W as one sequential stream, faster
    than MKL's products for few rows; without it, for 2-4 rows MKL's weight-major product (W x^T)^T
    streams faster than F.linear (docs/benchmarks.md, "Tensor parallel Llama inference against
    DeepSpeed AutoTP and transformers", the native skinny product's rows).
    """
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if x.dim() != 2 or x.device.type != "cpu" or rows < 1:
        return F.linear(x, weight, bias)
    kernels = kernels_if_cpu_fp32(kernels, x, weight)
    native = kernels is not None and x.is_contiguous() and weight.is_contiguous()
    if rows > MAX_ROWS:
        if not native or kernels.gemm is None:
            return F.linear(x, weight, bias)
        y = kernels.gemm.linear(x, weight)
        return y if bias is None else y.add_(bias)
    if native:
        y = kernels.skinny_linear(x, weight)
        return y if bias is None else y.add_(bias)
    if not 2 <= rows <= 4:
        return F.linear(x, weight, bias)
    y = torch.mm(weight, x.t()).t()
    return y if bias is None else y + bias


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class QuantizableWeight:
    """What the parallel linears share to hold their shard quantized (`--quantization`).

    `set_quantization` before loading drops the float weight (never filled: no fp32 copy is kept);
    the loaders then hand their row blocks to a QuantizedShard, and the packed shard becomes
    `quantized` (or, where no kernel applies, the float `weight` again)."""

    weight: Optional[nn.Parameter]
    _shard: Optional[QuantizedShard] = None
    weight_parts = 1  # weight loader calls that make the shard

    @property
    def quantized(self) -> Optional[nn.Module]:
        """The packed shard (GroupQuantLinear, Int8Linear or Int4Linear) once loaded quantized, else None."""
        return self._modules.get("qlinear")

    def set_quantization(self, scheme: str, rows: Optional[int] = None) -> None:
        if scheme == "none":
            return
        self._shard = QuantizedShard(scheme, self.weight.dtype, self.name, self.weight_parts, rows)
        self.weight = None

    def _load_quantized(self, source, rows: slice, cols: slice, offset: int, label: str) -> None:
        packed = self._shard.add(source, rows, cols, offset, label, native=self.kernels is not None)
        if packed is not None:
            self._shard = None
            self.hold(packed)

    def hold(self, packed: nn.Module) -> None:
        """Compute with `packed` (what pack_block made of the shard): a FloatLinear's weight becomes
        `weight` again, anything else `quantized`. A tied LM head is handed its embedding's."""
        if isinstance(packed, FloatLinear):
            self.weight = nn.Parameter(packed.weight, requires_grad=False)
        else:
            self.add_module("qlinear", packed)

    def _matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.quantized is None:
            return skinny_linear(x, self.weight, bias, self.kernels)
        y = self.quantized(x, self.kernels)
        return y if bias is None else y + bias


class ColumnParallelLinear(QuantizableWeight, nn.Module):
    """y[:, shard] = x W[shard]^T: this rank computes out_features / tp of the outputs."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: Communicator,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        name: str = "linear",
        out_range: Optional[tuple[int, int]] = None,
    ):
        """`out_range` (start, length): this rank's output rows when a subclass decides them; by
        default a balanced split."""
        super().__init__()
        self.tp, self.name = tp, name
        self.in_features, self.out_features = in_features, out_features
        self.out_start, self.out_local = out_range or shard_range(
            out_features, tp.size, tp.rank, f"{name}: output features"
        )
        self.weight = _param(self.out_local, in_features, dtype=dtype)
        self.bias = _param(self.out_local, dtype=dtype) if bias else None
        self.kernels: Optional[CpuKernels] = None  # the native CPU kernels, given by use_native_kernels

    def weight_loader(self, source, which: str = "weight") -> None:
        full = (self.out_features, self.in_features) if which == "weight" else (self.out_features,)
        check_shape(f"{self.name}.{which}", source, full)
        if which == "weight" and self._shard is not None:
            rows = slice(self.out_start, self.out_start + self.out_local)
            return self._load_quantized(source, rows, slice(None), 0, f"{self.name}.weight")
        copy_into(getattr(self, which), narrow(source, 0, self.out_start, self.out_local), f"{self.name}.{which}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one GEMM (gate and up).

    The local weight is [shard of part 0; shard of part 1; ...], so a rank's output splits
    into the parts' shards with one `split`.
    """

    def __init__(
        self,
        in_features: int,
        part_sizes: Sequence[int],
        tp: Communicator,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        name: str = "merged",
    ):
        # each part split on its own (uneven splits of the parts need not add up to a split of the sum)
        part_ranges = [shard_range(p, tp.size, tp.rank, f"{name}: part of {p} features") for p in part_sizes]
        super().__init__(
            in_features, sum(part_sizes), tp, bias, dtype, name, out_range=(0, sum(length for _, length in part_ranges))
        )  # the parts' loaders place the rows
        self.part_sizes, self.part_ranges = list(part_sizes), part_ranges
        self.part_local = [length for _, length in part_ranges]
        self.weight_parts = len(part_sizes)

    def weight_loader(self, source, part: int, which: str = "weight") -> None:
        size = self.part_sizes[part]
        full = (size, self.in_features) if which == "weight" else (size,)
        check_shape(f"{self.name}[{part}].{which}", source, full)
        start, local = self.part_ranges[part]
        offset = sum(self.part_local[:part])
        if which == "weight" and self._shard is not None:
            return self._load_quantized(
                source, slice(start, start + local), slice(None), offset, f"{self.name}[{part}].weight"
            )
        dest = getattr(self, which).narrow(0, offset, local)
        copy_into(dest, narrow(source, 0, start, local), f"{self.name}[{part}].{which}")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._matmul(x, self.bias).split(self.part_local, dim=-1)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused, sharded by heads; KV heads replicated when tp exceeds them."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        tp: Communicator,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        name: str = "qkv_proj",
    ):
        nn.Module.__init__(self)
        self.tp, self.name = tp, name
        self.layout = HeadLayout(num_heads, num_kv_heads, tp.size, tp.rank)
        self.hidden, self.head_dim = hidden, head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.q_size = self.layout.q_heads * head_dim
        self.kv_size = self.layout.kv_heads * head_dim
        out = self.q_size + 2 * self.kv_size
        self.in_features, self.out_features = hidden, out
        self.weight = _param(out, hidden, dtype=dtype)
        self.bias = _param(out, dtype=dtype) if bias else None
        self.kernels: Optional[CpuKernels] = None
        self.weight_parts = 3

    def weight_loader(self, source, part: str, which: str = "weight") -> None:
        """Load `part` in {'q', 'k', 'v'} from the full q_proj / k_proj / v_proj tensor."""
        d, lay = self.head_dim, self.layout
        heads = self.num_heads if part == "q" else self.num_kv_heads
        full = (heads * d, self.hidden) if which == "weight" else (heads * d,)
        check_shape(f"{self.name}.{part}.{which}", source, full)
        if part == "q":
            start, length, offset = lay.q_start * d, self.q_size, 0
        else:
            start, length = lay.kv_start * d, self.kv_size
            offset = self.q_size + (0 if part == "k" else self.kv_size)
        if which == "weight" and self._shard is not None:
            return self._load_quantized(
                source, slice(start, start + length), slice(None), offset, f"{self.name}.{part}.weight"
            )
        dest = getattr(self, which).narrow(0, offset, length)
        copy_into(dest, narrow(source, 0, start, length), f"{self.name}.{part}.{which}")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._matmul(x, self.bias).split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(QuantizableWeight, nn.Module):
    """y = sum over tp ranks of x[:, shard] W[:, shard]^T: input already split, all-reduce out.

    `in_range` (start, length): the input columns this rank holds when the layer before decides
    them (o_proj takes the columns of this rank's attention heads); by default a balanced split."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: Communicator,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        reduce_results: bool = True,
        name: str = "linear",
        in_range: Optional[tuple[int, int]] = None,
    ):
        super().__init__()
        self.tp, self.name = tp, name
        self.in_features, self.out_features = in_features, out_features
        self.in_start, self.in_local = in_range or shard_range(in_features, tp.size, tp.rank, f"{name}: input features")
        self.reduce_results = reduce_results
        self.weight = _param(out_features, self.in_local, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self.kernels: Optional[CpuKernels] = None

    def weight_loader(self, source, which: str = "weight") -> None:
        if which == "bias":  # not sharded: added once, after the reduction
            check_shape(f"{self.name}.bias", source, (self.out_features,))
            copy_into(self.bias, narrow(source, 0, 0, self.out_features), f"{self.name}.bias")
            return
        check_shape(f"{self.name}.weight", source, (self.out_features, self.in_features))
        if self._shard is not None:
            cols = slice(self.in_start, self.in_start + self.in_local)
            return self._load_quantized(source, slice(0, self.out_features), cols, 0, f"{self.name}.weight")
        copy_into(self.weight, narrow(source, 1, self.in_start, self.in_local), f"{self.name}.weight")

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum, before the all-reduce (so the caller can overlap it)."""
        return self._matmul(x, None)

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        """What follows the all-reduce: the bias, added once."""
        return y if self.bias is None else y + self.bias

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The partial sums of every row -> the layer's output: all-reduced (in place), bias added."""
        if self.reduce_results:
            reduce_from_tp(y, self.tp)
        return self.add_bias(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.partial(x))
