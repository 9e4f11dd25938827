"""The cp size for a prompt: every rank gets at least its floor of the longest prompt."""

from __future__ import annotations

import pytest

from dist_infer.parallel.ring.errors import RingAttentionError
from dist_infer.parallel.ring.sizing import MIN_TOKENS_PER_CP_RANK as m, choose_cp_size


def test_choose_cp_size_gives_every_rank_its_floor_of_the_longest_prompt():
    assert choose_cp_size(2 * m - 1, 8) == 1, "two ranks would get less than the floor each"
    assert choose_cp_size(2 * m, 8) == 2
    assert choose_cp_size(3 * m + 5, 8) == 3, "any size, not only powers of two"
    assert choose_cp_size(1 << 20, 2) == 2, "never more than the ranks there are"
    assert choose_cp_size(0, 4) == 1
    assert choose_cp_size(9000, 4, min_tokens_per_rank=1000) == 4
    with pytest.raises(RingAttentionError, match="-5-token prompt"):
        choose_cp_size(-5, 2)
