"""RMSNorm, the norm of every family here (Llama's and the MoE families' layers, Qwen3's per-head
norm of q and k), with the native CPU and Triton kernels it runs on where they serve."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dist_infer.kernels import kernels_if_cpu_fp32


class RMSNorm(nn.Module):
    """HF's RMSNorm: normalise in fp32, scale in the input dtype. On the CPU in fp32 one native
    pass per row (kernels/cpu_kernels.c) instead of six torch ops."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.kernels = None  # the native CPU kernels, given by use_native_kernels
        self.gpu_kernels = None  # the Triton kernels, given by use_gpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gpu = self._gpu(x)
        if gpu is not None:
            return gpu.rms_norm(x, self.weight, self.eps)[1]
        kernels = self._native(x)
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def _native(self, x: torch.Tensor):
        return kernels_if_cpu_fp32(self.kernels, x, self.weight) if x.dim() == 2 and x.is_contiguous() else None

    def _gpu(self, x: torch.Tensor):
        gpu = self.gpu_kernels
        return gpu if gpu is not None and x.dim() == 2 and x.stride(-1) == 1 and gpu.serves(x) else None

    def add_and_norm(self, x: torch.Tensor, branch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + branch, norm(x + branch)): the residual add and the next norm in one pass where
        the native kernel serves (x is then updated in place: it is the layer's own residual), or
        in one Triton kernel on the GPU."""
        gpu = self._gpu(x)
        if gpu is not None and branch.shape == x.shape and branch.stride(-1) == 1:
            return gpu.rms_norm(x, self.weight, self.eps, residual=branch)
        kernels = self._native(x)
        if (
            kernels is not None
            and branch.shape == x.shape
            and branch.is_contiguous()
            and kernels_if_cpu_fp32(kernels, branch)
        ):
            return x, kernels.rms_norm(x, self.weight, self.eps, residual=branch)
        x = x + branch
        return x, self(x)
