"""Native CPU kernels for the hot spots torch's own ops handle poorly (the decode step's
skinny products). Compiled from C on first use with the system compiler (build.py: once per node,
DIST_INFER_KERNELS=auto|require|off) and called through ctypes (cpu_kernels.py); where they cannot
be built everything falls back to torch. Models get them only through `use_native_kernels` (an
explicit switch). A leaf part: it imports nothing else from dist_infer."""

from dist_infer.kernels.build import KernelBuildError, kernel_mode, load_cpu_kernels
from dist_infer.kernels.cpu_kernels import MAX_ROWS, CpuKernels, kernels_if_cpu_fp32, use_native_kernels

__all__ = [
    "MAX_ROWS",
    "CpuKernels",
    "KernelBuildError",
    "kernel_mode",
    "kernels_if_cpu_fp32",
    "load_cpu_kernels",
    "use_native_kernels",
]
