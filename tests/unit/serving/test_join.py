"""`serve --join HOST:PORT`: the hub's address read with a clear error for anything else."""

from __future__ import annotations

import pytest

from dist_infer.serving.join import hub_to_join
from dist_infer.serving.spawn import HUB_KEY_ENV


def test_join_addresses(monkeypatch):
    monkeypatch.setenv(HUB_KEY_ENV, "k")
    assert hub_to_join("10.0.0.1:4242", None) == (("10.0.0.1", 4242), b"k")
    assert hub_to_join("[::1]:4242", None) == (("::1", 4242), b"k")
    for bad in ("h:99999", "h:0", "h:²", "h:", ":80", "h", ""):
        with pytest.raises(ValueError, match="HOST:PORT"):
            hub_to_join(bad, None)

