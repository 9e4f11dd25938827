"""A receive posted on the peer link (comm/peer/link.py): the tensor its message fills (through a
host buffer for a device tensor), whether a message fits it, and its completion, which runs the
receive's callback on the link's reader thread."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Optional

import torch
from loguru import logger

from dist_infer.comm.base import CommTimeoutError, Handle
from dist_infer.comm.peer.auth import Address
from dist_infer.comm.peer.sender import Key, PeerLinkError, as_bytes, fmt

if TYPE_CHECKING:
    from dist_infer.comm.peer.link import PeerLink


class RecvHandle(Handle):
    """A posted receive: done when its message is in `tensor` (or failed: `wait` raises)."""

    def __init__(
        self,
        link: "PeerLink",
        key: Key,
        tensor: torch.Tensor,
        peer: Address,
        on_done: Optional[Callable[["RecvHandle"], None]],
    ):
        self.link, self.key, self.tensor, self.peer, self.on_done = link, key, tensor, peer, on_done
        # the socket writes host memory: a device destination gets a host buffer, pinned for CUDA, copied on wait
        self.staging = (
            tensor
            if tensor.device.type == "cpu" and tensor.is_contiguous()
            else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        )
        self.error: Optional[Exception] = None
        self._event = threading.Event()

    def finish(self, error: Optional[Exception] = None) -> None:
        """Complete the receive (failed with `error`, if given) and run its callback: once, later calls
        do nothing."""
        if self._event.is_set():
            return
        self.error = error
        self._event.set()
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception as exc:  # noqa: BLE001 - a callback must not kill the reader thread
                logger.warning(f"peer link: receive callback for {self.key} failed: {exc}")

    def is_completed(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> None:
        limit = self.link.timeout if timeout is None else timeout
        if not self._event.wait(limit):
            raise CommTimeoutError(
                f"peer link: no message {self.key} from {self.peer[0]}:{self.peer[1]} within {limit:g} s"
            )
        if self.error is not None:
            raise self.error
        if self.staging is not self.tensor:
            self.tensor.copy_(self.staging)

    def mismatch(self, sender: Address, size: int) -> Optional[PeerLinkError]:
        """Why a message of `size` bytes from `sender` cannot fill this receive, or None if it can."""
        if sender != self.peer:
            return PeerLinkError(
                f"peer link: message {self.key} came from {fmt(sender)}, the receive expects it from {fmt(self.peer)}"
            )
        expected = as_bytes(self.staging).numel()
        if size != expected:
            return PeerLinkError(f"peer link: message {self.key} has {size} bytes, the receive expects {expected}")
        return None

    def fill(self, sender: Address, data: bytearray) -> None:
        """Complete with a message the link holds whole (it came before this receive); one that does
        not fit fails the receive instead."""
        error = self.mismatch(sender, len(data))
        if error is not None:
            return self.finish(error)
        if data:  # frombuffer refuses an empty buffer
            as_bytes(self.staging).copy_(torch.frombuffer(data, dtype=torch.uint8))
        self.finish()
