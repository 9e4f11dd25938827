"""The GPU kernels as one object the model's modules hold, and the switch that hands it to them."""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch


def triton_interpreting() -> bool:
    """Whether Triton runs its kernels in its interpreter (TRITON_INTERPRET=1): then on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class GpuKernels:
    """The Triton kernels a decoder layer uses on a GPU (kernels/gpu/layer_ops.py, paged_decode.py)."""

    def __init__(self):
        from dist_infer.kernels.gpu import layer_ops, paged_decode

        self._ops, self._attention = layer_ops, paged_decode
        self.interpreting = triton_interpreting()

    def serves(self, *tensors: torch.Tensor) -> bool:
        """Whether the kernels run where these tensors are: CUDA, or the CPU under the interpreter."""
        return all(t.is_cuda or (self.interpreting and t.device.type == "cpu") for t in tensors)

    def rms_norm(self, x, weight, eps, residual=None):
        return self._ops.rms_norm(x, weight, eps, residual)

    def rope_cache_write(self, q, k, v, cos, sin, k_cache, v_cache, slots, q_heads: int) -> None:
        self._ops.rope_cache_write(q, k, v, cos, sin, k_cache, v_cache, slots, q_heads)

    def silu_mul(self, gate, up):
        return self._ops.silu_mul(gate, up)

    def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, scale, window=None):
        return self._attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window)


def load_gpu_kernels() -> Optional[GpuKernels]:
    """The kernels, or None where Triton is not installed (the torch ops then serve)."""
    if importlib.util.find_spec("triton") is None:
        return None
    return GpuKernels()


def use_gpu_kernels(module: torch.nn.Module, kernels: Optional[GpuKernels]) -> None:
    """Give `kernels` (None: torch's ops) to every submodule with a `gpu_kernels` attribute (the
    norms, attention and MLPs). The explicit switch."""
    for m in module.modules():
        if hasattr(m, "gpu_kernels"):
            setattr(m, "gpu_kernels", kernels)  # (Module's __setattr__, typed for tensors and modules only)
