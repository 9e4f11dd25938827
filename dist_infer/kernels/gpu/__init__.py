"""Triton kernels for the GPU decode step: paged attention read in place, and the layer's small
ops fused (RMSNorm with its residual add, rotary with the cache write, SiLU-and-multiply).

Each is a host function over torch tensors with the reference math beside it in torch, so the
models can fall back to torch where Triton is missing and the tests can hold the kernels to the
reference on the CPU under TRITON_INTERPRET=1. Models get them only through `use_gpu_kernels`
(an explicit switch, like the CPU kernels' `use_native_kernels`); a leaf like the rest of kernels/.
"""

from dist_infer.kernels.gpu.ops import GpuKernels, load_gpu_kernels, triton_interpreting, use_gpu_kernels

__all__ = ["GpuKernels", "load_gpu_kernels", "triton_interpreting", "use_gpu_kernels"]
