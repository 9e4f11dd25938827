"""How many ranks a prompt's ring should span: the choice behind `--cp auto`.

A ring step has fixed costs (its send/recv calls, the LSE merge, each extra process's Python)
that only a long enough shard hides. On a CPU cp=2 loses clearly below 2K tokens, is close to one
process from 8K and ahead at 16K (docs/benchmarks.md, "Where cp=2 stops losing"): hence about 4096
tokens per rank. No GPU figure is measured yet, so the same per-rank floor is used there. Pure:
unit tested without processes.
"""

from __future__ import annotations

from dist_infer.parallel.ring.errors import RingAttentionError

MIN_TOKENS_PER_CP_RANK = 4096


def choose_cp_size(longest_prompt: int, max_cp: int, min_tokens_per_rank: int = MIN_TOKENS_PER_CP_RANK) -> int:
    """The largest cp size <= `max_cp` that gives every rank at least `min_tokens_per_rank` of the
    longest prompt; 1 when even two ranks would get less."""
    if longest_prompt < 0 or max_cp < 1 or min_tokens_per_rank < 1:
        raise RingAttentionError(
            f"cp size for a {longest_prompt}-token prompt on up to {max_cp} ranks with at least "
            f"{min_tokens_per_rank} tokens each: all must be positive"
        )
    return max(1, min(max_cp, longest_prompt // min_tokens_per_rank))
