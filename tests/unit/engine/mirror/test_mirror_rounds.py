"""KV mirroring's two sides on real schedulers and block pools (engine/mirror/, reached through
the migration endpoint as the front end's calls reach it), driven call by call as
serving/mirror/mirror_round.py does: the source offers its running requests' full blocks by hash
(and holds them), the buddy leases what it holds already and reserves fresh blocks for the rest,
the commit caches them under their hashes, and a request with the same tokens then starts from
them (a failover's prefix hit). Rounds are incremental, a fraction caps the leases, a lease's
blocks are taken back before any request of the buddy's is preempted, and every block is
accounted for (free + used + evictable == total) after commits, cancels and releases."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dist_infer.engine.kv_transfer import PeerInstance, TransferOp
from dist_infer.engine.migration import MigrationEndpoint
from dist_infer.engine.mirror import MirrorAnswer
from dist_infer.engine.request import Request
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.scheduler import Scheduler
from dist_infer.engine.scheduler_config import SchedulerConfig

BS = 4
PROMPT = [5 + i for i in range(6 * BS + 1)]  # 6 full blocks and one token


class FakeInstance:
    """An engine as the mirror sees it: a scheduler, the transfers it queues, a mover whose every
    stage is done."""

    def __init__(self, index: int, num_blocks: int = 40):
        self.index = index
        self.scheduler = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BS, prefix_caching=True))
        self.block_size = BS
        self.ops: list[TransferOp] = []
        self.events: list[tuple] = []
        self.mover = SimpleNamespace(stage_done=lambda mid, stage: True, failures=set())
        self.endpoint = MigrationEndpoint(self, lambda *event: self.events.append(event))

    @property
    def pool(self):
        return self.scheduler.allocator

    def queue_transfer(self, op):
        self.ops.append(op)

    def add(self, request_id, prompt=PROMPT, max_new_tokens=40):
        r = Request(request_id, list(prompt), SamplingParams(max_new_tokens=max_new_tokens), seed=1)
        self.scheduler.add(r)
        return r

    def step(self, token: int = 7):
        for chunk in self.scheduler.schedule().chunks:
            if chunk.sample:
                chunk.request.output_token_ids.append(token)
                self.scheduler.on_sampled(chunk.request)

    def peer(self):
        return PeerInstance(self.index, 1, 1, (("127.0.0.1", 1000 + self.index),))

    def accounted(self):
        assert self.pool.check() is None, self.pool.check()


def call(fn, *args):
    got = []
    fn(*args, got.append)
    assert len(got) == 1
    if isinstance(got[0], BaseException):
        raise got[0]
    return got[0]


def mirror_round(src: FakeInstance, buddy: FakeInstance, mid: int, fraction: float = 1.0, max_blocks: int = 1000):
    """One round as the front end makes it; (entries, answers)."""
    out, store = src.endpoint.mirror_out, buddy.endpoint.mirror_in
    entries = call(out.offer, mid, buddy.peer(), max_blocks)
    if not entries:
        return entries, []
    answers = call(store.reserve, mid, src.peer(), entries, fraction)
    call(out.send, mid, answers, buddy.peer())
    assert call(store.commit, mid) is True
    assert call(out.done, mid, True) is True
    return entries, answers


def test_a_round_mirrors_the_full_blocks_and_a_resumed_request_starts_from_them():
    src, buddy = FakeInstance(0), FakeInstance(1)
    r = src.add("r")
    src.step()  # the prompt: 6 full blocks computed
    held_before = [src.pool.refcount(b) for b in r.block_table[:6]]
    entries = call(src.endpoint.mirror_out.offer, 1, buddy.peer(), 1000)
    assert [(e.request_id, e.first, len(e.hashes)) for e in entries] == [("r", 0, 6)]
    assert [src.pool.refcount(b) for b in r.block_table[:6]] == [n + 1 for n in held_before], "held while read"
    answers = call(buddy.endpoint.mirror_in.reserve, 1, src.peer(), entries, 1.0)
    assert answers == [MirrorAnswer((True,) * 6, 6)]
    recv = buddy.ops[-1]
    assert recv.kind == TransferOp.RECV and len(recv.blocks) == 6
    assert call(src.endpoint.mirror_out.send, 1, answers, buddy.peer()) == 6
    send = src.ops[-1]
    assert send.kind == TransferOp.SEND and send.blocks == r.block_table[:6] and send.peer.index == 1
    assert buddy.endpoint.mirror_in.snapshot()["committed_blocks"] == 0, "not before the commit"
    assert not src.endpoint.failovers_may_arrive, "the source holds nobody's blocks"
    call(buddy.endpoint.mirror_in.commit, 1)
    assert buddy.endpoint.mirror_in.snapshot()["committed_blocks"] == 6
    assert not buddy.endpoint.failovers_may_arrive, "a short request's blocks: steps of prompts alone stay unpaced"
    call(src.endpoint.mirror_out.done, 1, True)
    assert [src.pool.refcount(b) for b in r.block_table[:6]] == held_before
    assert buddy.pool.num_leased == 6 and buddy.endpoint.mirror_in.held_for(0, "r") == 6
    assert buddy.pool.num_free == buddy.pool.num_blocks, "leased blocks stay allocatable"
    # its instance dies: the same tokens resumed on the buddy start from the mirrored blocks
    again = buddy.add("r", PROMPT + r.output_token_ids)
    again.resumed = True
    buddy.step()
    assert buddy.scheduler.prefix_cache_hits == 6 * BS
    assert buddy.scheduler.failover_recomputed_tokens == len(PROMPT) + 1 - 6 * BS
    for side in (src, buddy):
        side.accounted()


def test_rounds_are_incremental_and_a_new_buddy_gets_everything():
    src, buddy, other = FakeInstance(0), FakeInstance(1), FakeInstance(2)
    r = src.add("r")
    src.step()
    mirror_round(src, buddy, 1)
    assert mirror_round(src, buddy, 2) == ([], []), "nothing new: nothing offered"
    for _ in range(2 * BS):
        src.step()
    entries, answers = mirror_round(src, buddy, 3)
    assert [(e.first, len(e.hashes)) for e in entries] == [(6, 2)] and answers[0].have == 8
    assert src.endpoint.mirror_out.lag() == (0, 0)
    # each round sampled the request's lag: its prompt's 6 blocks at once, then none, then 2 of its output
    assert src.endpoint.mirror_out.snapshot()["lag_samples"] == {"prompt": {6: 1}, "output": {0: 1, 2: 1}}
    entries, _ = mirror_round(src, other, 4)
    assert [(e.first, len(e.hashes)) for e in entries] == [(0, 8)]
    assert r.num_computed // BS == 8
    for side in (src, buddy, other):
        side.accounted()


def test_what_the_buddy_caches_already_is_leased_not_sent():
    src, buddy = FakeInstance(0), FakeInstance(1)
    buddy.add("mine")
    buddy.step()
    buddy.step()  # the buddy computed the same prompt: its blocks are cached there (registered a step later)
    src.add("r")
    src.step()
    store = buddy.endpoint.mirror_in
    answers = call(store.reserve, 1, src.peer(), call(src.endpoint.mirror_out.offer, 1, buddy.peer(), 1000), 1.0)
    assert answers == [MirrorAnswer((False,) * 6, 6)]
    held = store.snapshot()
    assert (held["leased_blocks"], held["committed_blocks"]) == (6, 0), "leased at the reserve, not yet committed"
    call(src.endpoint.mirror_out.send, 1, answers, buddy.peer())
    assert call(store.commit, 1) is True and call(src.endpoint.mirror_out.done, 1, True) is True
    assert store.snapshot()["committed_blocks"] == 6
    assert not [op for op in buddy.ops if op.kind == TransferOp.RECV]
    assert buddy.endpoint.mirror_in.counters.blocks_already_held == 6
    src.accounted()
    buddy.accounted()


def test_the_fraction_caps_the_leases_and_the_source_offers_the_rest_later():
    src, buddy = FakeInstance(0), FakeInstance(1, num_blocks=40)
    src.add("r")
    src.step()
    _, answers = mirror_round(src, buddy, 1, fraction=0.1)  # 4 of 40 blocks
    assert answers == [MirrorAnswer((True,) * 4, 4)]
    assert buddy.endpoint.mirror_in.counters.blocks_refused == 2
    entries, answers = mirror_round(src, buddy, 2, fraction=1.0)
    assert [(e.first, len(e.hashes)) for e in entries] == [(4, 2)] and answers[0].have == 6
    buddy.accounted()


def test_the_buddy_takes_leased_blocks_back_before_preempting_and_the_source_rewinds():
    src, buddy = FakeInstance(0, num_blocks=40), FakeInstance(1, num_blocks=12)
    src.add("r")
    src.step()
    mirror_round(src, buddy, 1)  # 6 of the buddy's 12 blocks leased
    own = buddy.add("own", [900 + i for i in range(10 * BS)], max_new_tokens=4)
    buddy.step()  # needs 11 blocks: 6 free, 5 from the leases
    assert own.num_computed == 10 * BS and buddy.scheduler.num_preemptions == 0
    store = buddy.endpoint.mirror_in
    assert store.counters.blocks_reclaimed >= 5 and store.held_for(0, "r") <= 1
    buddy.accounted()
    # the source's next round learns the buddy holds less and offers from there
    for _ in range(BS):
        src.step()
    out = src.endpoint.mirror_out
    entries = call(out.offer, 2, buddy.peer(), 1000)
    answers = call(store.reserve, 2, src.peer(), entries, 1.0)
    assert answers[0].send == () and answers[0].have == store.held_for(0, "r")
    call(out.send, 2, answers, buddy.peer())
    call(store.commit, 2)
    call(out.done, 2, True)
    have = store.held_for(0, "r")
    entries, answers = mirror_round(src, buddy, 3)
    assert entries[0].first == have and answers[0].have == have + len(answers[0].send)  # as room allows
    buddy.accounted()


def test_release_and_cancel_give_every_block_back():
    src, buddy = FakeInstance(0), FakeInstance(1)
    src.add("r")
    src.step()
    out, store = src.endpoint.mirror_out, buddy.endpoint.mirror_in
    entries = call(out.offer, 1, buddy.peer(), 1000)
    call(store.reserve, 1, src.peer(), entries, 1.0)
    call(store.cancel, 1)
    call(out.done, 1, False)
    assert buddy.pool.num_leased == 0 and buddy.pool.num_free == buddy.pool.num_blocks
    assert buddy.ops[-1].kind == TransferOp.CANCEL
    assert out.lag() == (6, 6), "a cancelled round mirrored nothing"
    mirror_round(src, buddy, 2)
    assert store.release(0, ("r",)) == 1
    assert buddy.pool.num_leased == 0 and buddy.pool.num_evictable == 6, "released: cached, evictable"
    for side in (src, buddy):
        side.accounted()


@pytest.fixture
def long_request(monkeypatch):
    """A source and its buddy, where a request of 8 tokens or more mirrors its partial block too, and
    request "r" after its first step (6 full blocks and one row of the 7th)."""
    from dist_infer.engine.mirror import source, store as store_module

    monkeypatch.setattr(source, "LONG_REQUEST_TOKENS", 8)
    monkeypatch.setattr(store_module, "LONG_REQUEST_TOKENS", 8)
    src, buddy = FakeInstance(0), FakeInstance(1)
    r = src.add("r")
    src.step()
    buddy.registry = SimpleNamespace(count_added=lambda: None, register=lambda request: None)  # for take_over
    return src, buddy, r


def test_a_long_request_s_partial_block_is_mirrored_and_a_failover_runs_on_from_it(long_request):
    src, buddy, r = long_request
    entries, answers = mirror_round(src, buddy, 1)
    assert entries[0].tail == (PROMPT[-1],) and answers[0].tail, "the partial block's computed rows go too"
    recv = [op for op in buddy.ops if op.kind == TransferOp.RECV][-1]
    assert len(recv.blocks) == 7 and src.ops[-1].blocks == r.block_table[:7]
    assert buddy.endpoint.failovers_may_arrive, "a long request's blocks: its steps of prompts alone are paced"
    store = buddy.endpoint.mirror_in
    first_tail = store._tails[(0, "r")].block
    src.step()
    src.step()  # two more rows: the tail grew, its full blocks did not
    entries, answers = mirror_round(src, buddy, 2)
    assert [(e.first, len(e.hashes), len(e.tail)) for e in entries] == [(6, 0, 3)] and answers[0].tail
    assert store._tails[(0, "r")].block != first_tail and buddy.pool.refcount(first_tail) == 0, "the old tail freed"
    assert mirror_round(src, buddy, 3) == ([], []), "nothing grew: nothing offered"
    # its instance dies with one more token sampled: the buddy runs it on from the tail
    again = Request("r", list(PROMPT), SamplingParams(max_new_tokens=40), seed=1)
    again.output_token_ids = list(r.output_token_ids)
    assert store.take_over(again)
    assert again.num_computed == len(PROMPT) + 2 and again.block_table[:6] == store._leases[(0, "r")]
    assert buddy.scheduler.failover_recomputed_tokens == again.num_tokens - again.num_computed == 1
    n = again.num_tokens
    buddy.step()  # computes its last token's KV and samples the next, as its source would have
    assert again.num_computed == n and again.num_tokens == n + 1
    assert store.release(0, ("r",)) == 1 and buddy.pool.check() is None
    src.accounted()


def test_a_tail_that_does_not_fit_the_request_is_not_taken_over(long_request):
    src, buddy, _ = long_request
    mirror_round(src, buddy, 1)
    other = Request("r", [3] + PROMPT[1:], SamplingParams(max_new_tokens=40), seed=1)  # another first token
    assert not buddy.endpoint.mirror_in.take_over(other) and other.num_computed == 0
    assert buddy.endpoint.mirror_in.release(0) == 1 and buddy.pool.num_free == buddy.pool.num_blocks
    buddy.accounted()


def test_a_buddy_that_let_go_gets_the_blocks_and_the_partial_block_again(long_request):
    src, buddy, _ = long_request
    mirror_round(src, buddy, 1)
    store = buddy.endpoint.mirror_in
    assert store.release(0) == 1 and not store._tails, "the buddy let go of everything (a re-pairing, say)"
    src.step()
    src.step()  # two more rows: the partial block is offered, and the buddy's answer rewinds the source
    entries, answers = mirror_round(src, buddy, 2)
    assert answers[0].send == () and answers[0].have == 0, "the buddy holds nothing: the source rewinds"
    entries, answers = mirror_round(src, buddy, 3)
    assert entries[0].first == 0 and len(entries[0].hashes) == 6 and entries[0].tail and answers[0].tail
    assert store.held_for(0, "r") == 6 and (0, "r") in store._tails
    buddy.accounted()
