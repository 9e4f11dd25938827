"""The one error type of the ring package, apart so that every ring module can raise it
without importing another's concepts."""

from __future__ import annotations


class RingAttentionError(ValueError):
    """Inputs the ring cannot take; the message names the shapes and counts."""
