"""When a step's tokens are split in two halves for the tp overlap (the halves' attention metadata:
tests/unit/models/test_attention_metadata.py; the overlap run for real, exact against HF:
tests/integration/test_shm_and_overlap.py)."""

from __future__ import annotations

import pytest

from dist_infer.parallel.token_split import should_split


def test_should_split_modes():
    assert not should_split("off", 4096, 2, 1024)
    assert should_split("on", 2, 2, 1024)
    assert not should_split("on", 1, 2, 1024)  # one token cannot be split
    assert not should_split("on", 4096, 1, 1024)  # nothing to overlap without tp
    assert should_split("auto", 1024, 2, 1024) and not should_split("auto", 1023, 2, 1024)
    assert not should_split("auto", 1 << 20, 2, None)  # the CPU default: auto never splits
    with pytest.raises(ValueError, match="overlap mode"):
        should_split("sometimes", 10, 2, 1)
