"""How many KV blocks a request holds at its full length, and whether it can ever fit a cache:
what the scheduler, the offline batch sizing and the serving layer's dispatch all ask."""

from __future__ import annotations

from typing import Optional

from dist_infer.engine.kv_cache import blocks_for


def cp_rows_needed(num_prompt: int, num_generated: int, cp: int) -> int:
    """An upper bound on the KV rows any one of `cp` ranks holds for a sequence: its two zigzag
    chunks of the prompt (ceil(P / 2cp) rows each) and its round-robin share of the decode tokens."""
    chunk = -(-num_prompt // (2 * cp))
    return 2 * chunk + -(-num_generated // cp)


def blocks_at_full_length(prompt_len: int, max_new_tokens: int, block_size: int, cp: int = 1) -> int:
    """KV blocks (per rank) a request holds at its full length."""
    tokens = prompt_len + max_new_tokens
    # cp: a shard holds at most 2 ceil(a / 2cp) + ceil(b / cp) <= ceil((a + b) / cp) + 2 rows for a
    # prompt of a tokens and b decoded ones, however a preemption redrew the line between them
    rows = tokens if cp == 1 else -(-(tokens - 1) // cp) + 2
    return blocks_for(rows, block_size)


def check_fits(prompt_len: int, max_new_tokens: int, num_blocks: int, block_size: int, cp: int = 1) -> Optional[str]:
    """Why a request can never run in a cache of `num_blocks` (its full length needs more), or None."""
    tokens = prompt_len + max_new_tokens
    need = blocks_at_full_length(prompt_len, max_new_tokens, block_size, cp)
    if need > num_blocks:
        return f"needs {need} KV blocks of {block_size} tokens for {tokens} tokens, the cache has {num_blocks}"
    return None


def waiting_demand(scheduler) -> int:
    """KV blocks a scheduler's waiting queue needs to run to the end (Llumnix counts queued demand as
    used; max_tokens tells us the rest of it)."""
    return sum(_full_length_blocks(scheduler, r) for r in scheduler.waiting)


def growth_demand(scheduler) -> int:
    """KV blocks a scheduler's running requests still need to reach their max_tokens."""
    return sum(max(0, _full_length_blocks(scheduler, r) - len(r.block_table)) for r in scheduler.running)


def _full_length_blocks(scheduler, r) -> int:
    c = scheduler.config
    return blocks_at_full_length(len(r.prompt_token_ids), r.params.max_new_tokens, c.block_size, scheduler.cp)
