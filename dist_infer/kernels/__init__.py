"""Native CPU kernels for the hot spots torch's own ops handle poorly (the decode step's
skinny products). Compiled from C on first use with the system compiler and called through
ctypes; where no compiler is available everything falls back to torch. Models get them only
through `use_native_kernels` (an explicit switch). A leaf part: it imports nothing else from
dist_infer."""

from dist_infer.kernels.build import CpuKernels, load_cpu_kernels, serving, use_native_kernels

__all__ = ["CpuKernels", "load_cpu_kernels", "serving", "use_native_kernels"]
