"""Fake CUDA tensors on a CPU-only build: device placement checked without a GPU.

Under torch's FakeTensorMode a tensor made with device="cuda" has a shape, a dtype and a device
but no data, and an op that mixes it with a CPU tensor raises FakeTensorDeviceMismatchError. Two
things stand in the way on a CPU-only build, and this module removes them:

- Python indexing (`x[1:3]`, `x[rows]`), `.contiguous()` and `.to("cuda")` open a CUDA device
  guard before they dispatch, and a CPU-only build has none ("PyTorch is not linked with support
  for cuda devices"). `load_fake_cuda_guard` compiles a three-line library that registers c10's
  no-op guard for CUDA (the one torch itself installs on CUDA builds without a device) and loads
  it: nothing runs on a device, the guard only stops refusing.
- Inside FakeTensorMode every tensor is fake, the host's bookkeeping too (step plans, block
  tables), and `.tolist()` of a fake raises. `FakeCudaMode` keeps pure host work real: an op
  with no fake input that makes nothing on a device runs on real CPU tensors, so the engine's
  host side has its values and only what touches the (fake) device is fake.

A seam may give a fake device tensor known values (`with_values`: a fixed sampled token): copied
to the host, it arrives with them, so the engine's real device -> host path carries them on.

What the mode reports, besides torch's own device mismatches:
- `NeedsRealValues`: a fake result written into a real host tensor (a device -> host copy);
  the device's values are unknown, so the run stops there, as `.tolist()` of a fake does.
- `ImplicitHostCopy`: a device tensor indexed by a CPU index tensor. torch allows it on CUDA,
  copying the index to the device on the spot and synchronising: a step's inputs are meant to be
  on the device already, moved there once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import weakref
from pathlib import Path
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_leaves

_GUARD_SOURCE = """#include <c10/core/impl/DeviceGuardImplInterface.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
"""
_loaded: dict[str, Optional[str]] = {}
_INDEX_OPS = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
}


class NeedsRealValues(RuntimeError):
    """A device tensor's values were needed on the host: fake tensors have none."""


class ImplicitHostCopy(RuntimeError):
    """A device tensor indexed with a CPU index tensor (a hidden host -> device copy and sync)."""


def load_fake_cuda_guard() -> Optional[str]:
    """Register a no-op CUDA device guard in this process (once); None when done, else why not.
    Built with the system C++ compiler against torch's headers and libc10, cached by torch version."""
    if "done" in _loaded:
        return _loaded["done"]
    if torch.cuda.is_available() or torch.backends.cuda.is_built():
        _loaded["done"] = None  # a CUDA build has its own guard
        return None
    root = Path(torch.__file__).parent
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None or not (root / "include" / "c10").is_dir():
        _loaded["done"] = "no C++ compiler or no torch headers to build the fake CUDA device guard"
        return _loaded["done"]
    key = hashlib.sha256((_GUARD_SOURCE + torch.__version__).encode()).hexdigest()[:12]
    target = Path(tempfile.gettempdir()) / f"dist_infer_fake_cuda_guard-{os.getuid()}-{key}.so"
    if not target.exists():
        with tempfile.TemporaryDirectory() as tmp:
            src, out = Path(tmp) / "guard.cpp", Path(tmp) / "guard.so"
            src.write_text(_GUARD_SOURCE)
            proc = subprocess.run(
                [
                    cxx,
                    "-std=c++17",
                    "-shared",
                    "-fPIC",
                    f"-I{root / 'include'}",
                    str(src),
                    "-o",
                    str(out),
                    f"-L{root / 'lib'}",
                    "-lc10",
                    f"-Wl,-rpath,{root / 'lib'}",
                ],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                _loaded["done"] = f"building the fake CUDA device guard failed: {proc.stderr[-400:]}"
                return _loaded["done"]
            os.replace(out, target)  # atomic: concurrent test processes race benignly
    ctypes.CDLL(str(target))
    _loaded["done"] = None
    return None


def _device_of(kwargs: dict) -> Optional[torch.device]:
    device = kwargs.get("device")
    return None if device is None else torch.device(device)


class FakeCudaMode(FakeTensorMode):
    """FakeTensorMode where pure host work stays real (see the module docstring).

    `pinned`: how many host buffers were asked for in pinned memory (real ones here are pageable:
    a CPU-only build cannot pin), so a test can see that host copies of device values are pinned."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        self.pinned = 0
        self._known: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # id(fake) -> (the fake, its real values)

    def with_values(self, values: torch.Tensor, device: str = "cuda") -> torch.Tensor:
        """A fake `device` tensor whose values are known: `values`, which a copy to the host gives."""
        with self:
            fake = torch.empty(values.shape, dtype=values.dtype, device=device)
        self._known = {i: entry for i, entry in self._known.items() if entry[0]() is not None}
        self._known[id(fake)] = (weakref.ref(fake), values.clone())
        return fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func.overloadpacket is torch.ops.aten.to:  # reaches a mode undecomposed under inference_mode
            with self:  # the mode is off inside its own dispatch: the decomposition must meet it again
                return func.decompose(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        fake = [t for t in tensors if isinstance(t, FakeTensor)]
        device = _device_of(kwargs)
        if not fake and (device is None or device.type == "cpu"):
            return self._on_host(func, args, kwargs)
        if func in _INDEX_OPS:
            _check_indices(func, args)
        known = self._to_host_known(func, args, kwargs)
        if known is not None:
            return known
        _check_writes(func, args, kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _to_host_known(self, func, args, kwargs) -> Optional[torch.Tensor]:
        """A device -> host copy of a tensor with known values: the real copy, or None."""
        src = args[1] if func is torch.ops.aten.copy_.default else args[0] if args else None
        ref, values = self._known.get(id(src), (None, None))
        if ref is None or ref() is not src:  # (tensors compare by value: look them up by identity)
            return None
        if func is torch.ops.aten.copy_.default and not isinstance(args[0], FakeTensor):
            return args[0].copy_(values)
        device = _device_of(kwargs)
        if func is torch.ops.aten._to_copy.default and device is not None and device.type == "cpu":
            return values.to(kwargs.get("dtype") or src.dtype)
        return None

    def _on_host(self, func, args, kwargs):
        """A pure host op, run for real; pinning is counted and skipped (no CUDA runtime here)."""
        if func is torch.ops.aten.is_pinned.default:
            return False
        if func in (torch.ops.aten._pin_memory.default, torch.ops.aten.pin_memory.default):
            self.pinned += 1
            return args[0].clone()
        if kwargs.pop("pin_memory", False):
            self.pinned += 1
        return func(*args, **kwargs)


def _check_indices(func, args) -> None:
    self_, indices = args[0], args[1]
    if self_.device.type == "cpu":
        return
    for index in indices:
        if isinstance(index, torch.Tensor) and index.device.type == "cpu" and index.dim() > 0:
            raise ImplicitHostCopy(
                f"{func}: a {self_.device} tensor {tuple(self_.shape)} indexed with a CPU index "
                f"tensor {tuple(index.shape)}: build the index on the device"
            )


def _check_writes(func, args, kwargs) -> None:
    """A fake op writing into a real (host) tensor: the values it would write do not exist."""
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
                raise NeedsRealValues(
                    f"{func}: writes device values into a host tensor {tuple(t.shape)} "
                    f"({t.dtype}); a fake device has none"
                )


def on_fake_device(module: torch.nn.Module, mode: FakeCudaMode, device: str = "cuda") -> torch.nn.Module:
    """`module.to(device)` inside `mode`: its parameters and buffers become fake `device` tensors,
    exactly what `.to` moves (plain tensor attributes stay where they were, as on a real GPU)."""
    with mode:
        return module.to(device)


def is_on(t: torch.Tensor, device: str) -> bool:
    return t.device.type == torch.device(device).type
