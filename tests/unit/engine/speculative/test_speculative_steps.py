"""Speculation's bookkeeping without a model: the scheduler puts a decode's proposals in its chunk
(as many as the budget, max_tokens and the free blocks allow, never preempting for them) and
counts only the request's own token computed; accepted proposals count as they are appended and
the blocks past them go back; a stop inside an accepted run ends it there; the step plan carries
K + 1 sampled positions and the rows to draw them with; the metadata asks for their logits."""

from __future__ import annotations

import torch

from dist_infer.engine.intake import RequestRegistry
from dist_infer.engine.request import Request, RequestStatus
from dist_infer.engine.request_progress import RequestProgress
from dist_infer.engine.sampling import RowSampling, SampledTokens, SamplingParams
from dist_infer.engine.scheduler import Scheduler
from dist_infer.engine.scheduler_config import SchedulerConfig
from dist_infer.engine.speculative.verification import accepted_prefix
from dist_infer.engine.step_plan import KIND_WORK, StepPlan, decode, encode
from dist_infer.models.attention_metadata import build_attention_metadata, logit_rows


class FixedDrafter:
    """Proposes `tokens` (cut to the limit) for every decode; remembers the rounds recorded."""

    def __init__(self, tokens):
        self.tokens, self.rounds, self.forgotten = list(tokens), [], []

    def propose(self, request, limit):
        return self.tokens[: max(0, limit)]

    def record(self, request, proposed, accepted):
        self.rounds.append((proposed, accepted))

    def forget(self, request):
        self.forgotten.append(request.request_id)


def _decoding(scheduler: Scheduler, prompt_len=6, max_new=20, **params) -> Request:
    """A request past its prefill, with one output token: its next step is a decode."""
    r = Request("r", list(range(3, 3 + prompt_len)), SamplingParams(max_new_tokens=max_new, **params), seed=0)
    scheduler.add(r)
    (chunk,) = scheduler.schedule().chunks
    assert chunk.sample and not chunk.draft, "a prompt chunk carries no proposals"
    r.output_token_ids.append(50)
    r.emitted_tokens = 1
    scheduler.on_sampled(r)
    return r


def test_a_decode_carries_its_proposals_and_counts_only_its_own_token():
    s = Scheduler(SchedulerConfig(num_blocks=20, block_size=4), drafter=FixedDrafter([7, 8, 9]))
    r = _decoding(s)
    (chunk,) = s.schedule().chunks
    assert (chunk.start, chunk.num_tokens, chunk.draft, chunk.sample) == (6, 4, [7, 8, 9], True)
    assert r.num_computed == 7 and r.num_tokens == 7, "the proposals are not computed yet"
    assert len(r.block_table) == 3, "blocks for 6 + 1 + 3 tokens"


def test_proposals_are_cut_to_the_budget_max_tokens_and_free_blocks_without_preempting():
    s = Scheduler(SchedulerConfig(num_blocks=20, block_size=4, max_batched_tokens=3), drafter=FixedDrafter([7] * 8))
    _decoding(s, prompt_len=3)
    assert s.schedule().chunks[0].draft == [7, 7], "budget 3: the token and two proposals"
    s = Scheduler(SchedulerConfig(num_blocks=20, block_size=4), drafter=FixedDrafter([7] * 8))
    _decoding(s, max_new=4)
    assert s.schedule().chunks[0].draft == [7, 7], "1 of 4 generated: 2 proposals and the step's own token"
    s = Scheduler(SchedulerConfig(num_blocks=3, block_size=4, watermark=0.0), drafter=FixedDrafter([7] * 8))
    other = Request("o", [1, 2, 3], SamplingParams(max_new_tokens=2), seed=0)
    r = _decoding(s)  # 6 + 1 tokens: 2 blocks, 1 free
    s.add(other)  # waits: no room next to r's growth
    out = s.schedule()
    (chunk,) = [c for c in out.chunks if c.request is r]
    assert len(chunk.draft) == 5, "the one free block holds 5 more tokens"
    assert not out.preempted and s.num_free_blocks == 0


def test_accepted_proposals_count_and_the_blocks_past_them_go_back():
    s = Scheduler(SchedulerConfig(num_blocks=20, block_size=4), drafter=FixedDrafter([7, 8, 9, 10, 11]))
    r = _decoding(s)
    (chunk,) = s.schedule().chunks
    assert len(r.block_table) == 3 and s.num_free_blocks == 17  # 6 + 1 + 5 = 12 tokens
    progress = RequestProgress(s, RequestRegistry(), eos_token_ids=(2,), max_positions=100)
    targets = [7, 8, 33, 40, 41, 42]  # the target agrees with two proposals, then says 33
    a = accepted_prefix(chunk.draft, targets)
    sampled = SampledTokens(torch.tensor(targets), torch.zeros(6, dtype=torch.float64))
    out = progress.take_tokens(r, sampled, 0, a, False, 0.0)
    assert a == 2 and out.new_token_ids == [7, 8, 33]
    assert (r.num_computed, r.num_tokens) == (9, 10), "the token, 7 and 8 computed; 33 is next"
    assert len(r.block_table) == 3 and s.num_free_blocks == 17, "9 tokens still need 3 blocks"
    (chunk,) = s.schedule().chunks
    assert chunk.start == 9 and chunk.num_tokens == 6
    sampled = SampledTokens(torch.tensor([1] * 6), torch.zeros(6, dtype=torch.float64))
    progress.take_tokens(r, sampled, 0, 0, False, 0.0)  # nothing accepted
    assert (r.num_computed, r.num_tokens) == (10, 11)
    assert len(r.block_table) == 3 and s.num_free_blocks == 17, "the fourth block (rejected proposals) went back"


def test_a_stop_inside_an_accepted_run_ends_it_there():
    for params, want, reason in [
        (dict(stop_token_ids=[8]), [7, 8], "stop"),
        (dict(max_new=3), [7, 8], "length"),  # 50 was the first of 3
        (dict(), [7, 2], "stop"),  # EOS
    ]:
        max_new = params.pop("max_new", 20)
        s = Scheduler(SchedulerConfig(num_blocks=20, block_size=4), drafter=FixedDrafter([7, 8, 9, 10]))
        r = _decoding(s, max_new=max_new, **params)
        s.schedule()
        progress = RequestProgress(s, RequestRegistry(), eos_token_ids=(2,), max_positions=100)
        targets = [7, 2, 9, 10, 11] if reason == "stop" and not params else [7, 8, 9, 10, 11]
        draft = [7, 2, 9, 10] if targets[1] == 2 else [7, 8, 9, 10]
        a = accepted_prefix(draft, targets)
        sampled = SampledTokens(torch.tensor(targets), torch.zeros(5, dtype=torch.float64))
        out = progress.take_tokens(r, sampled, 0, a, False, 0.0)
        assert out.new_token_ids == want and out.finished and out.finish_reason == reason, params
        assert r.status is RequestStatus.FINISHED and s.num_free_blocks == 20, "every block back"


def test_the_plan_carries_sampled_positions_and_their_rows():
    plan = StepPlan(
        kind=KIND_WORK,
        seq_ids=[1, 2, 3],
        num_tokens=[5, 4, 1],
        starts=[0, 10, 7],
        block_tables=[[0, 1], [2, 3, 4], [5, 6]],
        sample=[0, 4, 1],
        rows=[RowSampling(0.7, 5, 0.9, 11, 3, 2, 2), RowSampling(seed=4, index=9)],
        input_ids=[1, 2, 3, 4, 5, 9, 8, 7, 6, 5],
    )
    back = decode(*encode(plan))
    assert back.sample == [0, 4, 1] and back.rows == plan.rows
    assert plan.speculative and plan.logit_counts == [1, 4, 1]
    assert plan.sample_index == [1, 2, 3, 4, 5] and plan.num_sampled == 5 and plan.row_offsets() == [0, 4]
    rows = plan.position_rows()
    assert [(r.index, r.ban_eos) for r in rows] == [(3, 2), (4, 1), (5, 0), (6, 0), (9, 0)]
    assert all(r.seed == 11 and r.top_k == 5 for r in rows[:4])
    plain = StepPlan(sample=[True, False, True], rows=plan.rows)
    assert not plain.speculative and plain.sample_index == [0, 2] and plain.position_rows() is plain.rows


def test_the_metadata_asks_for_a_speculating_sequences_last_rows():
    assert logit_rows([5, 4, 1], None) is None and logit_rows([5, 4, 1], [1, 1, 1]) is None
    assert logit_rows([5, 4, 1], [1, 4, 1]).tolist() == [4, 5, 6, 7, 8, 9]
    meta = build_attention_metadata([5, 4, 1], [5, 14, 8], [[0, 1], [2, 3, 4, 5], [6, 7]], 4, None, [1, 4, 1])
    assert meta.logit_rows.tolist() == [4, 5, 6, 7, 8, 9] and meta.last_token_index.tolist() == [4, 8, 9]
