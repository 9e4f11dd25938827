"""A live migration to an instance whose prefix cache holds the request's prefix (engine/migration.py
on both sides, driven call by call as the orchestrator does, over real schedulers and block pools):
the destination claims the cached leading blocks at reservation, the source sends only the blocks
after them, the request runs on with the held blocks followed by the sent ones, and every block is
accounted for after a commit and after a cancel (free + used + cached-evictable == total)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dist_infer.engine.kv_transfer import PeerInstance, TransferOp
from dist_infer.engine.migration import MigrationEndpoint
from dist_infer.engine.request import Request, RequestStatus
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.scheduler import Scheduler
from dist_infer.engine.scheduler_config import SchedulerConfig

BS = 4
PREFIX = [5 + i for i in range(6 * BS)]  # 6 full blocks


class FakeInstance:
    """An engine as MigrationEndpoint sees it: a scheduler, requests by id, and transfers queued
    (recorded here; the mover reports every stage done)."""

    def __init__(self, num_blocks: int = 40):
        self.scheduler = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BS, prefix_caching=True))
        self.block_size = BS
        self.requests: dict[str, Request] = {}
        self.ops: list[TransferOp] = []
        self.mover = SimpleNamespace(stage_done=lambda mid, stage: True, failures=set())
        self.endpoint = MigrationEndpoint(self, lambda *event: None)

    def find(self, request_id):
        return self.requests.get(request_id)

    def queue_transfer(self, op):
        self.ops.append(op)

    def adopt(self, request, blocks):
        self.requests[request.request_id] = request
        self.scheduler.install(request, blocks)

    def hand_over(self, request):
        self.scheduler.hand_over(request)
        self.requests.pop(request.request_id)

    def add(self, request_id, prompt, max_new_tokens=8):
        r = Request(request_id, list(prompt), SamplingParams(max_new_tokens=max_new_tokens), seed=1)
        self.requests[request_id] = r
        self.scheduler.add(r)
        return r

    def step(self):
        """One step: every chunk that reaches its last token samples token 7."""
        for chunk in self.scheduler.schedule().chunks:
            if chunk.sample:
                chunk.request.output_token_ids.append(7)
                self.scheduler.on_sampled(chunk.request)

    def finish(self, request):
        self.scheduler.finish(request, "length")
        self.requests.pop(request.request_id)

    def call(self, method, *args):
        got = []
        getattr(self.endpoint, method)(*args, reply=got.append)
        assert len(got) == 1, (method, got)
        if isinstance(got[0], BaseException):
            raise got[0]
        return got[0]

    def accounted(self):
        assert self.scheduler.allocator.check() is None, self.scheduler.allocator.check()


def peer(index):
    return PeerInstance(index, 1, 1, (("127.0.0.1", 1000 + index),))


def sent_blocks(instance, kind):
    return [b for op in instance.ops if op.kind == kind for b in op.blocks]


def migrate(src, dst, request, mid=1):
    """The orchestrator's calls (serving/migration/live_migration.py): one stage while the request decodes on,
    then the pause and the rest; returns what the destination held already and the request's state."""
    info = src.call("start_out", mid, request.request_id, peer(1))
    held = dst.call("reserve_in", mid, peer(0), info["blocks"] + 2, info["hashes"])
    first, count = src.call("send_out", mid, 0, held)
    dst.call("recv_in", mid, 0, first, count)
    src.step()  # the request decodes on while the stage goes
    state, first, count = src.call("pause_out", mid, 1, True, held)  # no token on the way: answered at once
    dst.call("recv_in", mid, 1, first, count)
    return held, state


def computed_request(instance, request_id, prompt, steps):
    r = instance.add(request_id, prompt, max_new_tokens=20)
    for _ in range(steps):
        instance.step()
    return r


def test_the_destination_claims_its_cached_prefix_and_only_the_tail_is_sent():
    src, dst = FakeInstance(), FakeInstance()
    warm = computed_request(dst, "warm", PREFIX + [90, 91, 92], 2)  # dst computes the prefix ...
    dst.finish(warm)  # ... and keeps it cached
    assert dst.scheduler.num_cached_blocks >= 6
    cold = FakeInstance()
    r = computed_request(src, "r", PREFIX + [40 + i for i in range(3 * BS)], 3)  # 9 prompt blocks, decoding
    twin = computed_request(cold, "r", PREFIX + [40 + i for i in range(3 * BS)], 3)
    assert r.status is RequestStatus.RUNNING and r.output_token_ids

    held, state = migrate(src, dst, r)
    assert held == 6, "every prefix block dst caches is claimed"
    sent = sent_blocks(src, TransferOp.SEND)
    assert set(sent).isdisjoint(r.block_table[:6]), "no held block is sent"
    assert sent == r.block_table[6 : len(sent) + 6], "the tail goes, in order"

    cold_dst = FakeInstance()
    assert migrate(cold, cold_dst, twin)[0] == 0, "nothing cached: nothing held"
    assert len(sent_blocks(cold, TransferOp.SEND)) == len(sent) + 6, "a cold migration sends the prefix too"

    dst.call("commit_in", 1, state)
    moved = dst.find("r")
    cached_prefix = dst.scheduler.allocator.match(r.block_hashes[:6])
    assert moved.block_table[:6] == cached_prefix, "the held blocks are the cached ones"
    assert moved.block_table[6:] == sent_blocks(dst, TransferOp.RECV)[: len(moved.block_table) - 6]
    src.call("release_out", 1)
    assert "r" not in src.requests
    for _ in range(30):
        dst.step()
        if moved.num_tokens >= len(moved.prompt_token_ids) + 20:
            break
    dst.finish(moved)
    for inst in (src, dst):
        inst.accounted()
        assert inst.scheduler.num_free_blocks == inst.scheduler.config.num_blocks
    assert dst.scheduler.allocator.match(r.block_hashes[:6]) == cached_prefix, "the prefix stays cached on dst"


def test_a_cancelled_migration_gives_the_held_prefix_back_to_the_cache():
    src, dst = FakeInstance(), FakeInstance()
    dst.finish(computed_request(dst, "warm", PREFIX + [1], 2))
    evictable = dst.scheduler.num_cached_blocks
    r = computed_request(src, "r", PREFIX + [2, 3], 3)
    info = src.call("start_out", 1, "r", peer(1))
    assert dst.call("reserve_in", 1, peer(0), info["blocks"] + 2, info["hashes"]) == 6
    assert dst.scheduler.num_cached_blocks == evictable - 6, "held by the migration: not evictable meanwhile"
    dst.call("cancel_in", 1)
    src.call("resume_out", 1)
    assert dst.scheduler.num_cached_blocks == evictable, "back in the cache, not on the free list"
    dst.accounted()
    assert r.status is RequestStatus.RUNNING
    src.finish(r)
    src.accounted()


def test_no_room_counts_only_the_blocks_it_would_take():
    """A destination whose spare blocks are fewer than the request's table still takes it when the
    cached prefix makes up the difference; held blocks in use elsewhere cost nothing."""
    src, dst = FakeInstance(), FakeInstance(num_blocks=12)
    keep = computed_request(dst, "keep", PREFIX + [1], 2)  # holds the 6 prefix blocks (+1), running
    r = computed_request(src, "r", PREFIX + [2, 3, 4, 5, 6], 3)
    info = src.call("start_out", 1, "r", peer(1))
    assert info["blocks"] + 2 > dst.scheduler.num_free_blocks, "would not fit cold"
    assert dst.call("reserve_in", 1, peer(0), info["blocks"] + 2, info["hashes"]) == 6
    dst.call("cancel_in", 1)
    dst.finish(keep)
    dst.accounted()
    src.call("resume_out", 1)
    src.finish(r)


def test_a_grammar_the_destination_cannot_rebuild_cancels_the_commit_and_frees_its_blocks():
    """A structured request's grammar state is rebuilt on the destination before the commit; if that
    fails, the migration aborts (dest_failed), the destination frees what it reserved, and the
    request goes on at the source."""
    from dist_infer.engine.migration import MigrationAborted
    from dist_infer.engine.structured.spec import StructuredSpec

    class NoGrammars(FakeInstance):
        def start_grammar(self, request):
            raise RuntimeError("this instance cannot take the spec")

    src, dst = FakeInstance(), NoGrammars()
    r = Request("r", PREFIX + [1, 2], SamplingParams(max_new_tokens=8, structured=StructuredSpec("regex", "[0-9]+")), 1)
    src.requests["r"] = r
    src.scheduler.add(r)
    for _ in range(3):
        src.step()
    _, state = migrate(src, dst, r)
    with pytest.raises(MigrationAborted, match="grammar cannot be rebuilt") as info:
        dst.call("commit_in", 1, state)
    assert info.value.outcome == "dest_failed"
    assert dst.find("r") is None
    dst.accounted()
    assert dst.scheduler.num_free_blocks == dst.scheduler.config.num_blocks
    src.call("resume_out", 1)
    assert r.status is RequestStatus.RUNNING
    src.finish(r)
    src.accounted()
