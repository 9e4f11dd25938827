"""KV mirroring: each full KV block of a running request is copied, while the request runs on,
into a buddy instance's prefix cache, so that if the instance dies its requests go on at the
buddy recomputing only the blocks not yet mirrored (serving/mirror/ drives the rounds)."""

from dist_infer.engine.mirror.entries import MirrorAnswer, MirrorEntry
from dist_infer.engine.mirror.source import MirrorSource
from dist_infer.engine.mirror.store import MirrorStore

__all__ = ["MirrorAnswer", "MirrorEntry", "MirrorSource", "MirrorStore"]
