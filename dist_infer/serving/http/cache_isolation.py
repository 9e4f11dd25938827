"""Whose requests may share the prefix cache (`--prefix-cache-isolation`), as the salt each request carries.

A prompt whose prefix is cached answers its first token far sooner (docs/security.md, "The prefix
cache as a side channel"), so a client that shares the cache with others can tell whether any of
them sent a prompt: it sends a guess and times it. Requests share cached blocks only when their cache salts are equal
(engine/prefix_cache.py mixes the salt into a prompt's first block hash, and so into every block's).

- `none`: the salt is the request's own `cache_salt` (vLLM's field), or none. Clients that agree on
  nothing share everything; a client that sends a secret salt shares only with whoever knows it.
- `key` (the default whenever API keys are set): the front end salts every request with
  HMAC-SHA256(secret, its API key), the secret drawn per serve job in this process and never sent
  anywhere; a request's own `cache_salt` is mixed in by a second HMAC keyed with that key salt. So
  one key's requests never share a block with another key's, whatever salts either sends. Only the
  salt travels to the instance (in the request's SamplingParams), never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from typing import Optional

ISOLATION_MODES = ("none", "key")
SECRET_BYTES = 32


def isolation_mode(requested: Optional[str], has_api_keys: bool) -> str:
    """The mode asked for, or the default (`key` with API keys, `none` without); ValueError naming
    the flag for one not known or for `key` without keys (there would be nothing to isolate by)."""
    mode = requested or ("key" if has_api_keys else "none")
    if mode not in ISOLATION_MODES:
        raise ValueError(f"--prefix-cache-isolation must be one of {', '.join(ISOLATION_MODES)}, got {mode!r}")
    if mode == "key" and not has_api_keys:
        raise ValueError("--prefix-cache-isolation key needs API keys (--api-key): requests are isolated by key")
    return mode


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


@dataclass(frozen=True)
class CacheIsolation:
    """The front end's salting of requests; `secret` is drawn once per serve job (this object)."""

    mode: str = "none"
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(SECRET_BYTES), repr=False)

    def __post_init__(self):
        if self.mode not in ISOLATION_MODES:
            raise ValueError(f"prefix cache isolation must be one of {', '.join(ISOLATION_MODES)}, got {self.mode!r}")

    def cache_salt(self, api_key: Optional[str], request_salt: Optional[str]) -> Optional[str]:
        """The salt the engine hashes a request with: `request_salt` as is under `none`; under `key`
        the key's salt, with `request_salt` mixed in when there is one (64 hex digits after a tag
        that keeps the two forms apart)."""
        if self.mode == "none":
            return request_salt
        key_salt = hmac.new(self.secret, _utf8(api_key or ""), hashlib.sha256).digest()
        if request_salt is None:
            return "key:" + key_salt.hex()
        return "key+salt:" + hmac.new(key_salt, _utf8(request_salt), hashlib.sha256).hexdigest()
