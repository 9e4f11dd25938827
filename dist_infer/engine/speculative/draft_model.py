"""Proposals from a smaller model of the same vocabulary (`--speculative draft --draft-model PATH`).

The draft runs on the instance's driver alone (one rank, solo groups, its own KV cache and block
pool), greedily: before each step the driver asks it (`prepare`) for the next tokens of every decode
the step may take, in one batched forward per proposed position; the scheduler then takes them as it
takes prompt-lookup proposals, and the target verifies them the same way (engine/speculative: the
output is the target's own, whatever the draft says). Proposal lengths adapt per request as
draft_length.py says, priced by the step-cost model.

The draft's cache follows each request's ids: it holds the keys of the request's tokens up to
`computed`, and a round's first forward feeds whatever is missing (the prompt at first, the
accepted tokens later, at most `catch_up` a step) with the last token. After a round the proposals
the target accepted stay valid, the rest are written over next time. Nothing of it travels: a
request that moves or fails over starts a draft sequence afresh on its new instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dist_infer.comm.solo import solo_groups
from dist_infer.engine.block_pool import BlockPool
from dist_infer.engine.device_io import module_device
from dist_infer.engine.kv_cache import PagedKVCache, blocks_for
from dist_infer.engine.request import Request
from dist_infer.engine.speculative.config import SpeculativeConfig
from dist_infer.engine.speculative.counters import SpeculativeCounters
from dist_infer.engine.speculative.draft_length import DraftLength
from dist_infer.engine.step_plan import KIND_WORK, StepPlan
from dist_infer.engine.worker import StageWorker

CATCH_UP = 256  # draft tokens a request may compute in one round beyond its last (a prompt at first)


class DraftModelError(ValueError):
    """A draft model this target cannot use (its vocabulary differs); names --draft-model."""


def load_draft_stage(path: str, target) -> object:
    """The draft checkpoint as one whole stage on the target's device and dtype, on this rank alone."""
    from dist_infer.models.loader import load_stage

    stage, _ = load_stage(path, solo_groups(), target.dtype, device=module_device(target))
    if stage.cfg.vocab_size != target.cfg.vocab_size:
        raise DraftModelError(
            f"--draft-model {path}: its vocabulary has {stage.cfg.vocab_size} tokens, the model's "
            f"{target.cfg.vocab_size}: a draft must share the model's tokenizer"
        )
    return stage


@dataclass
class _DraftSequence:
    table: list[int] = field(default_factory=list)
    computed: int = 0  # leading tokens of the request whose keys are in the draft's cache


class DraftModelDrafter:
    """Greedy proposals from `stage` (load_draft_stage), its cache of `num_blocks` blocks of
    `block_size`; never past `max_positions`; `counters` get every round's outcome."""

    def __init__(
        self,
        config: SpeculativeConfig,
        stage,
        max_positions: int,
        counters: SpeculativeCounters,
        num_blocks: int,
        block_size: int,
    ):
        self.config, self.stage, self.max_positions, self.counters = config, stage, max_positions, counters
        self.block_size = block_size
        cache = PagedKVCache(
            len(stage.layers),
            num_blocks,
            block_size,
            max(1, stage.kv_heads_local),
            stage.cfg.head_dim,
            stage.dtype,
            module_device(stage),
        )
        self.worker = StageWorker(stage, solo_groups(), cache, block_size, "off", None, "off", None, "auto", "off")
        self.pool = BlockPool(num_blocks)
        self.row_cost = self.step_cost = 0.0  # set by the driver before each step
        self._sequences: dict[str, _DraftSequence] = {}
        self._lengths: dict[str, DraftLength] = {}
        self._ready: dict[str, tuple[int, list[int]]] = {}  # request -> (its tokens when drafted, proposals)

    # -- the scheduler's side ------------------------------------------------------------------
    def propose(self, request: Request, limit: int) -> list[int]:
        """The proposals `prepare` made for `request` at its current length, cut to `limit`."""
        at, proposals = self._ready.pop(request.request_id, (-1, []))
        if at != request.num_tokens or limit <= 0:
            return []
        return proposals[:limit]

    def record(self, request: Request, proposed: int, accepted: int) -> None:
        """The target kept the first `accepted` of `proposed`: those proposals' keys stay."""
        self.counters.record(proposed, accepted)
        length = self._lengths.get(request.request_id)
        if length is not None:
            length.record(proposed, accepted)
        seq = self._sequences.get(request.request_id)
        if seq is not None:  # it computed the last token and the proposals but the last
            seq.computed = min(seq.computed, request.num_tokens + min(accepted, max(0, proposed - 1)))

    def forget(self, request: Request) -> None:
        seq = self._sequences.pop(request.request_id, None)
        if seq is not None and seq.table:
            self.pool.free(seq.table)
        for table in (self._lengths, self._ready):
            table.pop(request.request_id, None)

    # -- the driver's side: draft before the step ------------------------------------------------
    def _wanted(self, requests) -> list[tuple[Request, _DraftSequence, int]]:
        """The decodes that may speculate next step, their draft sequences and lengths."""
        out = []
        for r in requests:
            if r.in_flight or r.num_tokens - r.num_computed != 1 or r.params.structured is not None:
                continue
            if self._ready.get(r.request_id, (-1, []))[0] == r.num_tokens:
                continue  # drafted at this length already (pp: a step before this one left it out)
            length = self._lengths.setdefault(r.request_id, DraftLength(self.config.num_tokens, self.config.adaptive))
            room = min(r.params.max_new_tokens - len(r.output_token_ids) - 1, self.max_positions - r.num_tokens)
            k = min(length.next(self.row_cost), room)
            seq = self._sequences.setdefault(r.request_id, _DraftSequence())
            seq.computed = min(seq.computed, r.num_tokens - 1)
            if k <= 0 or r.num_tokens - seq.computed > CATCH_UP + 1 and not self._catch_up(r, seq):
                continue
            if self._grow(seq, r.num_tokens + k - 1):
                out.append((r, seq, k))
        return out

    def _grow(self, seq: _DraftSequence, tokens: int) -> bool:
        """Blocks for `tokens` in the draft's cache (False, and nothing taken, if the pool is short)."""
        need = blocks_for(tokens, self.block_size) - len(seq.table)
        if need > self.pool.num_free:
            return False
        seq.table += [self.pool.allocate() for _ in range(max(0, need))]
        return True

    def _catch_up(self, r: Request, seq: _DraftSequence) -> bool:
        """Compute CATCH_UP more of a request's missing tokens (a long prompt, over several steps);
        False: still behind, no proposals this step."""
        end = seq.computed + CATCH_UP
        if self._grow(seq, end):
            self._forward([(r.all_token_ids[seq.computed : end], seq)])
            seq.computed = end
        return False

    def _forward(self, rows: list[tuple[list[int], _DraftSequence]]) -> list[int]:
        """One batched draft forward: each sequence's new tokens after its computed ones; the greedy
        next token of each."""
        plan = StepPlan(
            kind=KIND_WORK,
            seq_ids=list(range(len(rows))),
            num_tokens=[len(ids) for ids, _ in rows],
            starts=[seq.computed for _, seq in rows],
            block_tables=[list(seq.table) for _, seq in rows],
            sample=[1] * len(rows),
            input_ids=[t for ids, _ in rows for t in ids],
        )
        meta = self.worker.prepare(plan)
        logits = self.worker.execute(plan, self.worker.token_inputs(plan, meta), meta)
        return logits.argmax(-1).tolist()

    def prepare(self, requests) -> None:
        """Draft the next tokens of every decode among `requests` that may speculate next step."""
        wanted = self._wanted(requests)
        gain = sum(self._lengths[r.request_id].expected_gain(k, self.row_cost) for r, _, k in wanted)
        if not wanted or gain <= self.step_cost:  # not worth the step's price: no drafting either
            return
        proposals: list[list[int]] = [[] for _ in wanted]
        with torch.inference_mode():
            rows = [(r.all_token_ids[seq.computed :], seq) for r, seq, _ in wanted]
            live = list(range(len(wanted)))
            for j in range(max(k for _, _, k in wanted)):
                tokens = self._forward([rows[i] for i in live])
                for i, token in zip(live, tokens):
                    ids, seq = rows[i]
                    seq.computed += len(ids)
                    proposals[i].append(token)
                    rows[i] = ([token], seq)
                live = [i for i in live if len(proposals[i]) < wanted[i][2]]
                if not live:
                    break
        for (r, _, _), drafted in zip(wanted, proposals):
            self._ready[r.request_id] = (r.num_tokens, drafted)


def build_drafter(
    config: SpeculativeConfig,
    target,
    is_driver: bool,
    counters: SpeculativeCounters,
    num_blocks: int,
    block_size: int,
    loaded: dict,
):
    """The drafter an engine's scheduler asks (None: no speculation here). A draft model is loaded
    on the driver only (the other ranks never propose), once per engine (`loaded` keeps it)."""
    from dist_infer.engine.speculative.drafter import NgramDrafter

    max_positions = target.cfg.max_positions
    if config.method == "ngram":
        return NgramDrafter(config, max_positions, counters)
    if not is_driver:
        return None
    if "stage" not in loaded:
        loaded["stage"] = load_draft_stage(config.draft_model, target)
    return DraftModelDrafter(config, loaded["stage"], max_positions, counters, num_blocks, block_size)
