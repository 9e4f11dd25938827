"""Exact ring attention: attention over a sequence sharded across the context-parallel group.

Each cp rank holds some rows of the sequence (queries, keys, values). The full attention is
computed block by block while either the keys/values (pass-KV) or the queries (pass-Q) travel
round the ring, and the partial results, each a normalised output O with its log-sum-exp L,
are merged exactly (reference.md section 6). No rank ever holds the whole sequence's K/V.

One concept per module, each depending only on those listed before it:

- errors:          RingAttentionError
- lse:             merging partial (O, LSE) results, locally and across ranks
- shards:          which positions a rank's rows hold (runs, the zigzag split)
- blocks:          the block plan of one ring step, and its FLOPs
- variant:         choosing pass-KV or pass-Q
- sizing:          how many ranks a prompt's ring should span (--cp auto)
- layout:          every rank's rows and the per-step block plans (RingLayout)
- local_attention: one block's attention with its LSE
- ring_loops:      the send/recv ring loops

The pure parts (merge, zigzag maps, block plan, variant heuristic, cp size) are unit tested without
processes; the ring loops take the cp communicator explicitly.
"""

from dist_infer.parallel.ring.blocks import Block, plan_blocks, ring_step_flops
from dist_infer.parallel.ring.errors import RingAttentionError
from dist_infer.parallel.ring.layout import RingLayout
from dist_infer.parallel.ring.local_attention import attention_with_lse, attention_with_lse_reference
from dist_infer.parallel.ring.lse import merge_across_ranks, merge_into, merge_many, merge_partials
from dist_infer.parallel.ring.ring_loops import ring_attention, ring_attention_pass_kv, ring_attention_pass_q
from dist_infer.parallel.ring.shards import Run, ZigzagShard, runs_from_positions, zigzag_chunks
from dist_infer.parallel.ring.sizing import MIN_TOKENS_PER_CP_RANK, choose_cp_size
from dist_infer.parallel.ring.variant import HARDWARE_ESTIMATES, VARIANTS, choose_ring_variant

__all__ = [
    "HARDWARE_ESTIMATES",
    "MIN_TOKENS_PER_CP_RANK",
    "VARIANTS",
    "Block",
    "RingAttentionError",
    "RingLayout",
    "Run",
    "ZigzagShard",
    "attention_with_lse",
    "attention_with_lse_reference",
    "choose_cp_size",
    "choose_ring_variant",
    "merge_across_ranks",
    "merge_many",
    "merge_into",
    "merge_partials",
    "plan_blocks",
    "ring_attention",
    "ring_attention_pass_kv",
    "ring_attention_pass_q",
    "ring_step_flops",
    "runs_from_positions",
    "zigzag_chunks",
]
