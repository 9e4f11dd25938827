"""The pure parts of live migration: who sends which KV heads and layers to whom, the step plan's
transfer ops, --instances parsing (layouts and roles), the command line of an instance started on
its own, the dispatch policies and the migration controller's choices; and the KV link between
two endpoints in one process (threads, real sockets)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import threading
import time

import pytest
import torch

from dist_infer.comm.base import CommTimeoutError
from dist_infer.comm.peer.link import PeerLink, PeerLinkError
from dist_infer.engine.kv_transfer import KVLayout, PeerInstance, TransferError, TransferOp, transfer_map
from dist_infer.engine.migration import MigratingRequest, MigrationAborted, MigrationOutcome
from dist_infer.engine.request import Request
from dist_infer.engine.sampling import RowSampling, SamplingParams
from dist_infer.engine.step_plan import KIND_IDLE, StepPlan, decode, encode
from dist_infer.serving.fleet.dispatch import Dispatcher, InstanceLoad
from dist_infer.serving.fleet.instance_specs import (
    InstancesError,
    InstanceSpec,
    base_ranks,
    check_roles,
    check_world,
    parse_instances,
)
from dist_infer.serving.fleet.wire import Hello, InstanceState, InstanceStats, Role
from dist_infer.serving.migration.rebalance_policy import MoveCandidate, plan_moves
from dist_infer.serving.placement.spawn import instance_argv


def _layout(tp, pp=1, layers=4, heads=8, kv=2):
    return KVLayout(tp, pp, layers, heads, kv)


PAIRS = [
    ((1, 1), (2, 1)),
    ((2, 1), (1, 1)),
    ((2, 1), (4, 1)),
    ((4, 1), (2, 1)),
    ((1, 1), (4, 1)),
    ((4, 1), (1, 1)),
    ((2, 2), (1, 1)),
    ((1, 1), (2, 2)),
    ((1, 2), (2, 1)),
    ((2, 1), (1, 3)),
    ((8, 1), (2, 2)),
]


@pytest.mark.parametrize("src,dst", PAIRS)
def test_every_destination_head_and_layer_comes_exactly_once_from_an_owner(src, dst):
    s = _layout(*src, layers=6)
    d = _layout(*dst, layers=6)
    pieces = transfer_map(s, d)
    for rank in range(d.size):
        got = [(layer, h, p.src) for p in pieces if p.dst == rank for layer in p.layers for h in p.heads]
        want = {(layer, h) for layer in d.layers_of(rank) for h in d.heads_of(rank)}
        assert sorted((layer, h) for layer, h, _ in got) == sorted(want), f"dst rank {rank}"
        for layer, h, sender in got:
            assert layer in s.layers_of(sender) and h in s.heads_of(sender), (layer, h, sender)


def test_replicated_heads_spread_over_their_owners():
    # 2 KV heads on tp4: ranks 0,1 hold head 0, ranks 2,3 head 1; tp4 -> tp4 takes each head from
    # both replicas in turn instead of always the first
    pieces = transfer_map(_layout(4), _layout(4))
    assert sorted((p.src, p.dst) for p in pieces) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    # tp2 -> tp4: each destination rank gets its one head from the single owner
    assert sorted((p.src, p.dst, tuple(p.heads)) for p in transfer_map(_layout(2), _layout(4))) == [
        (0, 0, (0,)),
        (0, 1, (0,)),
        (1, 2, (1,)),
        (1, 3, (1,)),
    ]


def test_tp2_to_tp1_sends_two_half_messages_and_tp1_to_tp2_one_each():
    assert sorted((p.src, p.dst, tuple(p.heads)) for p in transfer_map(_layout(2), _layout(1))) == [
        (0, 0, (0,)),
        (1, 0, (1,)),
    ]
    assert sorted((p.src, p.dst, tuple(p.heads)) for p in transfer_map(_layout(1), _layout(2))) == [
        (0, 0, (0,)),
        (0, 1, (1,)),
    ]


def test_pipeline_stages_split_by_layer_range():
    pieces = transfer_map(_layout(1, pp=2, layers=6), _layout(1, pp=3, layers=6))
    assert sorted((p.src, p.dst, (p.layers.start, p.layers.stop)) for p in pieces) == [
        (0, 0, (0, 2)),
        (0, 1, (2, 3)),
        (1, 1, (3, 4)),
        (1, 2, (4, 6)),
    ]


def test_different_models_do_not_exchange_blocks():
    with pytest.raises(TransferError, match="different models"):
        transfer_map(_layout(1, layers=4), _layout(1, layers=6))


def test_plan_carries_transfer_ops():
    peer = PeerInstance(2, 2, 1, (("127.0.0.1", 40001), ("10.0.0.7", 65535)))
    ops = [
        TransferOp(TransferOp.SEND, 7, 2, peer, [5, 9, 11]),
        TransferOp(TransferOp.COMMIT, 8),
        TransferOp(TransferOp.RECV, 9, 0, PeerInstance(0, 1, 2, (("192.168.1.2", 5),)), [3]),
    ]
    plan = StepPlan(
        seq_ids=[4],
        num_tokens=[1],
        starts=[10],
        block_tables=[[1, 2, 3]],
        sample=[True],
        rows=[RowSampling(0.0, 0, 1.0, 3, 4, 0, 0)],
        input_ids=[42],
        freed=[6],
        transfers=ops,
    )
    back = decode(*encode(plan))
    assert back.transfers == ops and back.freed == [6] and back.input_ids == [42] and back.block_tables == [[1, 2, 3]]
    idle = decode(*encode(StepPlan(kind=KIND_IDLE, transfers=ops[:1])))
    assert idle.kind == KIND_IDLE and idle.transfers == ops[:1]
    with pytest.raises(TransferError, match="IPv4"):
        TransferOp(TransferOp.SEND, 1, 0, PeerInstance(0, 1, 1, (("::1", 5),)), [1]).encode()


def test_peer_link_matches_messages_to_receives_in_any_order():
    a, b = PeerLink(timeout=5.0), PeerLink(timeout=5.0)
    try:
        x = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
        y = torch.randn(5, dtype=torch.float32)
        a.send(x, b.address, (1, 0, 0))  # before its receive is posted: it waits in memory
        got_x = torch.empty_like(x)
        h = b.irecv(got_x, a.address, (1, 0, 0))
        h.wait()
        assert torch.equal(got_x, x)
        seen = threading.Event()
        got_y = torch.empty_like(y)
        h = b.irecv(got_y, a.address, (1, 1, 0), on_done=lambda _: seen.set())  # posted first: filled in place
        a.isend(y, b.address, (1, 1, 0)).wait()
        h.wait()
        assert seen.wait(5) and torch.equal(got_y, y)
        # a cancelled migration's receives fail, and its late messages are dropped
        h = b.irecv(torch.empty(3), a.address, (2, 0, 0))
        b.drop(2)
        with pytest.raises(PeerLinkError, match="cancelled"):
            h.wait()
        a.send(torch.ones(3), b.address, (2, 0, 1))
        # a size mismatch is named; a message that never comes times out
        a.send(torch.ones(4), b.address, (3, 0, 0))
        with pytest.raises(PeerLinkError, match="16 bytes, the receive expects 12"):
            b.irecv(torch.empty(3), a.address, (3, 0, 0)).wait()
        with pytest.raises(CommTimeoutError, match=r"no message \(4, 0, 0\)"):
            b.irecv(torch.empty(3), a.address, (4, 0, 0)).wait(0.2)
    finally:
        a.close()
        b.close()


def test_peer_link_fails_receives_when_the_sender_goes_away():
    a, b = PeerLink(timeout=5.0), PeerLink(timeout=5.0)
    try:
        a.send(torch.ones(1), b.address, (1, 0, 0))  # connects
        b.irecv(torch.empty(1), a.address, (1, 0, 0)).wait()
        h = b.irecv(torch.empty(2), a.address, (1, 1, 0))
        a.close()
        with pytest.raises(PeerLinkError, match="closed before"):
            h.wait()
        with pytest.raises(PeerLinkError, match="is gone"):  # and later receives from it fail at once
            b.irecv(torch.empty(2), a.address, (1, 2, 0)).wait()
        dead = PeerLink(timeout=1.0)
        gone = dead.address
        dead.close()
        with pytest.raises(PeerLinkError, match="failed"):
            b.isend(torch.ones(1), gone, (1, 0, 0)).wait()
    finally:
        b.close()


def test_instance_argv_keeps_the_model_flags_and_drops_the_apis():
    spec = parse_instances("decode:tp2")[0]
    argv = [
        "serve",
        "--model",
        "/m",
        "--instances",
        "tp2,tp1",
        "--port=8001",
        "--kv-blocks",
        "64",
        "--ready-file",
        "/r.json",
        "--dispatch",
        "rr",
        "--backend",
        "mpi",
        "--protect-metrics",
        "--max-num-seqs",
        "8",
        "--api-key",
        "k1",
        "--api-key=k2",
        "--admin-key",
        "a",
        "--frontend-only",
        "--hub-host",
        "10.0.0.1",
    ]
    assert instance_argv(argv, 3, spec, ("10.0.0.1", 4242)) == [
        "serve",
        "--model",
        "/m",
        "--kv-blocks",
        "64",
        "--max-num-seqs",
        "8",
        "--instances",
        "decode:tp=2",
        "--join",
        "10.0.0.1:4242",
        "--instance-index",
        "3",
    ]


def test_spawned_instances_share_the_host_s_cores(monkeypatch):
    """Instances started side by side split the cores instead of each taking all (oversubscribed);
    a user's OMP_NUM_THREADS wins."""
    import dist_infer.serving.placement.spawn as spawn_module

    started = []
    monkeypatch.setattr(spawn_module.subprocess, "Popen", lambda cmd, env, **kw: started.append(env))
    monkeypatch.setattr(spawn_module, "threads_per_rank", lambda ranks: max(1, 8 // ranks))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spec = parse_instances("tp2,tp1,tp1")
    spawn = spawn_module.LocalSpawner(
        ["serve", "--model", "m"], ("127.0.0.1", 1), b"k", local_ranks=sum(x.size for x in spec)
    )
    spawn(0, spec[0])
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    spawn(1, spec[1])
    assert [env["OMP_NUM_THREADS"] for env in started] == ["2", "3"]


def test_parse_instances():
    assert parse_instances("tp2,tp1,tp1") == [InstanceSpec(2), InstanceSpec(1), InstanceSpec(1)]
    assert parse_instances("3", tp=2) == [InstanceSpec(2)] * 3
    assert parse_instances("tp2pp2, pp2") == [InstanceSpec(2, 2), InstanceSpec(1, 2)]
    assert base_ranks(parse_instances("tp2,tp1,tp4")) == [0, 2, 3]
    assert parse_instances("prefill:tp2,decode:tp1,decode:tp1") == [
        InstanceSpec(2, 1, "prefill"),
        InstanceSpec(1, 1, "decode"),
        InstanceSpec(1, 1, "decode"),
    ]
    assert parse_instances("prefill:tp2,tp1")[1].role == "mixed"
    assert [s.describe() for s in parse_instances("prefill:tp2pp2,mixed:tp1")] == ["prefill:tp=2,pp=2", "tp=1"]
    for bad in ("tp2,,tp1", "tpx", "dp2", "0", "tp0", "prefil:tp1", "prefill:"):
        with pytest.raises(InstancesError):
            parse_instances(bad)
    with pytest.raises(InstancesError, match="need a decode"):
        check_roles(parse_instances("prefill:tp1,prefill:tp1"))
    with pytest.raises(InstancesError, match="need a decode"):
        check_roles(parse_instances("decode:tp1"))
    check_roles(parse_instances("prefill:tp1,tp1"))
    with pytest.raises(InstancesError, match=r"2 \(tp=2\) \+ 1 \(tp=1\) = 3 ranks, the job has 4"):
        check_world(parse_instances("tp2,tp1"), 4)


def _load(i, free, total=100, running=0, waiting=0, demand=0, pending=0, pending_blocks=0, accepting=True):
    return InstanceLoad(i, free, total, 0, demand, running, waiting, pending, pending_blocks, accepting)


def test_load_dispatch_counts_queued_and_pending_demand():
    d = Dispatcher("load")
    # instance 0 has more free blocks, but its queue needs them all
    assert d.choose([_load(0, 80, running=2, waiting=2, demand=70), _load(1, 50, running=2)], 4) == 1
    # requests sent but not yet seen count as load
    assert d.choose([_load(0, 60, pending=3, pending_blocks=30), _load(1, 50)], 4) == 1
    # an instance that can never hold the request, or is draining, gets none
    assert d.choose([_load(0, 60, total=3), _load(1, 1)], 4) == 1
    assert d.choose([_load(0, 90, accepting=False), _load(1, 10)], 4) == 1
    assert d.choose([_load(0, 90, accepting=False)], 4) is None


def test_load_dispatch_places_a_long_request_where_it_leaves_the_most_per_request():
    # A holds one long request (55 blocks left after its growth), B two short ones (86 left): A's
    # freeness is higher now, but a 41-block request leaves (55-41)/2 = 7 there and (86-41)/3 = 15 on B
    a = InstanceLoad(0, 80, 96, running=1, growth_blocks=25)
    b = InstanceLoad(1, 90, 96, running=2, growth_blocks=4)
    assert a.freeness > b.freeness
    assert Dispatcher("load").choose([a, b], 41) == 1


def test_round_robin_and_shortest_queue():
    rr = Dispatcher("rr")
    loads = [_load(0, 10), _load(1, 10), _load(2, 10, accepting=False)]
    assert [rr.choose(loads, 1) for _ in range(4)] == [0, 1, 0, 1]
    q = Dispatcher("queue")
    assert q.choose([_load(0, 10, waiting=3), _load(1, 10, running=5, waiting=1), _load(2, 10, pending=2)], 1) == 1
    with pytest.raises(ValueError):
        Dispatcher("random")


def _cands(*pairs):
    return [MoveCandidate(r, b, b > 0) for r, b in pairs]


def test_controller_moves_the_cheapest_request_from_the_most_to_the_least_loaded():
    loads = [_load(0, 4, running=3, waiting=1, demand=10), _load(1, 90, running=1), _load(2, 60, running=1)]
    cands = {0: _cands(("w", 0), ("big", 30), ("small", 3)), 1: _cands(("x", 5)), 2: _cands(("y", 5))}
    moves = plan_moves(loads, cands, busy=set(), cooling=set(), draining=set())
    assert [(m.request_id, m.src, m.dst, m.reason) for m in moves] == [("w", 0, 1, "queue")]
    # the waiting one just moved: the next cheapest running one goes
    moves = plan_moves(loads, cands, busy=set(), cooling={"w"}, draining=set())
    assert [(m.request_id, m.dst) for m in moves] == [("small", 1)]


def test_controller_leaves_balanced_busy_and_full_instances_alone():
    balanced = [_load(0, 50, running=2), _load(1, 52, running=2)]
    assert plan_moves(balanced, {0: _cands(("a", 3))}, set(), set(), set()) == []
    loaded = [_load(0, 2, running=4, demand=8, waiting=1), _load(1, 90)]
    assert plan_moves(loaded, {0: _cands(("a", 3))}, busy={1}, cooling=set(), draining=set()) == []
    no_room = [_load(0, 2, running=4, demand=8, waiting=1), _load(1, 10)]
    assert plan_moves(no_room, {0: _cands(("a", 30))}, set(), set(), set()) == []


def test_drain_moves_everything_even_when_balanced():
    loads = [_load(0, 50, running=2), _load(1, 50, running=2)]
    moves = plan_moves(loads, {0: _cands(("a", 3), ("b", 1))}, set(), set(), draining={0})
    assert [(m.request_id, m.src, m.dst, m.reason) for m in moves] == [("b", 0, 1, "drain")]


def test_a_draining_instance_s_requests_go_to_its_kv_mirror_buddy_first():
    loads = [_load(0, 50, running=2), _load(1, 80, running=1), _load(2, 60, running=1)]
    cands = {0: _cands(("a", 3))}
    assert [m.dst for m in plan_moves(loads, cands, set(), set(), draining={0})] == [1], "the freest without buddies"
    moves = plan_moves(loads, cands, set(), set(), draining={0}, buddies={0: 2, 2: 1, 1: 0})
    assert [(m.request_id, m.dst, m.reason) for m in moves] == [("a", 2, "drain")]
    moves = plan_moves(loads, cands, {2}, set(), draining={0}, buddies={0: 2})
    assert [m.dst for m in moves] == [1], "a busy buddy: the next instance"


def test_a_migration_carries_only_what_the_destination_needs():
    r = Request(
        "r1",
        [1, 2, 3],
        SamplingParams(max_new_tokens=8),
        seed=5,
        num_computed=4,
        output_token_ids=[9],
        output_logprobs=[-0.5],
        output_top_logprobs=[[(9, -0.5)]],
        block_table=[3, 4],
        in_flight=True,
        logits=[object()],
        emitted_tokens=1,
    )
    t0 = time.monotonic()
    r.arrival_time, r.first_token_time = t0 - 2.0, t0 - 1.0
    state = MigratingRequest.of(r)
    took = time.monotonic() - t0  # (bounds, not a window: a busy machine may pause anywhere here)
    assert pickle.loads(pickle.dumps(state)) == state  # the wire: no block table, no logits, times as ages
    assert not {"block_table", "logits", "in_flight", "seq_id"} & {f.name for f in dataclasses.fields(state)}
    assert 2.0 <= state.age_s <= 2.0 + took and MigratingRequest.of(r, send_kv=False).num_computed == 0
    back = state.to_request()
    assert (
        back.output_token_ids,
        back.num_computed,
        back.emitted_tokens,
        back.block_table,
        back.in_flight,
        back.logits,
        back.seed,
    ) == ([9], 4, 1, [], False, [], 5)
    assert 2.0 - took <= time.monotonic() - back.arrival_time <= 2.0 + (time.monotonic() - t0)


def test_instance_stats_and_peers_read_the_typed_wire():
    stats = InstanceStats.from_dict(
        {"num_requests_running": 2, "running_ids": ["a", "b"], "free_blocks": 3, "not_a_stat": 1}
    )
    assert stats.running_ids == ("a", "b") and stats.watermark_blocks == 0
    assert stats.as_dict()["running_ids"] == ["a", "b"] and "not_a_stat" not in stats.as_dict()
    assert InstanceStats.empty(64).free_blocks == 64
    hello = Hello.from_fields(
        index=2,
        tp=2,
        pp=1,
        total_blocks=8,
        block_size=4,
        max_positions=64,
        vocab_size=10,
        role="decode",
        addresses=[["10.0.0.1", 5], ["10.0.0.1", 6]],
    )
    assert hello.role is Role.DECODE and PeerInstance.from_hello(hello).addresses == (("10.0.0.1", 5), ("10.0.0.1", 6))
    assert json.dumps([InstanceState.SERVING, MigrationOutcome.NO_ROOM]) == '["serving", "no_room"]'
    assert MigrationAborted("no_room", "x").outcome is MigrationOutcome.NO_ROOM
