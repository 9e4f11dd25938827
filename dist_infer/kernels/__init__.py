"""Native CPU kernels for the hot spots torch's own ops handle poorly (the decode step's
skinny products). Compiled from C on first use with the system compiler and called through
ctypes; where no compiler is available everything falls back to torch. A leaf part: it
imports nothing else from dist_infer."""

from dist_infer.kernels.build import CpuKernels, cpu_kernels, cpu_kernels_for

__all__ = ["CpuKernels", "cpu_kernels", "cpu_kernels_for"]
