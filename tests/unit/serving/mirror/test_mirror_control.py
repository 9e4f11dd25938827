"""MirrorControl's bookkeeping (serving/mirror/mirror_control.py) without processes: a request fails
over to the instance holding its mirror only if that instance takes requests and holds something;
a request's end releases its leases there; pairs change with the instances that serve, and a living
source's old buddy lets go of what it held while a dead source's leases wait for its requests."""

from __future__ import annotations

from types import SimpleNamespace

from dist_infer.serving.fleet.config import FleetConfig
from dist_infer.serving.fleet.mirror_wire import MirrorForget, MirrorRelease
from dist_infer.serving.fleet.wire import InstanceState
from dist_infer.serving.mirror.mirror_control import MirrorControl, MirrorRecord


class FakeControl:
    def __init__(self):
        self.submitted = []

    def submit(self, coro):
        self.submitted.append(coro)
        coro.close()  # never run: the calls it would make are read off `calls` below

    def spawn(self, coro):
        coro.close()


class FakeCalls:
    def __init__(self):
        self.made = []


def instance(index, node="a", state=InstanceState.SERVING, accepting=True):
    return SimpleNamespace(
        index=index,
        node=node,
        state=state,
        alive=state is InstanceState.SERVING,
        accepting=accepting and state is InstanceState.SERVING,
        hello=SimpleNamespace(cp=1),
        stats=SimpleNamespace(num_requests_running=0),
    )


def control_of(*instances):
    fleet = SimpleNamespace(instances=list(instances), requests={"r": object()}, stopping=False, block_bytes=1024)
    mirror = MirrorControl(fleet, FakeControl(), FakeCalls(), FleetConfig(kv_mirror="buddy"))
    calls: list = []
    mirror._call = lambda index, op: calls.append((index, op))
    return mirror, calls


def test_failover_goes_to_the_mirror_only_where_it_can():
    mirror, _ = control_of(instance(0), instance(1))
    assert mirror.failover_target("r") is None, "nothing mirrored"
    mirror.records["r"] = MirrorRecord(0, 1, 5)
    assert mirror.failover_target("r") == 1
    mirror.fleet.instances[1].accepting = False
    assert mirror.failover_target("r") is None, "a buddy that takes no requests"
    mirror.fleet.instances[1].accepting = True
    mirror.records["r"] = MirrorRecord(0, 1, 0)
    assert mirror.failover_target("r") is None, "a buddy that holds nothing of it"


def test_a_request_s_end_releases_its_leases_at_the_buddy():
    mirror, calls = control_of(instance(0), instance(1))
    mirror.records["r"] = MirrorRecord(0, 1, 5)
    mirror.request_ended("r")
    mirror.request_ended("r")  # twice: nothing more
    assert calls == [(1, MirrorRelease(0, ("r",)))] and "r" not in mirror.records


def test_pairs_follow_the_serving_instances():
    mirror, calls = control_of(instance(0, "a"), instance(1, "b"), instance(2, "a"))
    mirror._pair()
    assert mirror.pairs == {0: 1, 1: 2, 2: 0}
    mirror.records["r"] = MirrorRecord(1, 2, 4)
    mirror.fleet.instances[2].state, mirror.fleet.instances[2].alive = InstanceState.DEAD, False
    mirror._pair()
    assert mirror.pairs == {0: 1, 1: 0}
    # 1 mirrors to 0 now: the dead 2 is sent nothing; 2's own leases at 0 wait for its requests
    assert calls == [], calls
    assert "r" not in mirror.records, "its mirror died with its buddy"
    mirror.fleet.instances[1].state, mirror.fleet.instances[1].alive = InstanceState.DEAD, False
    mirror.records["s"] = MirrorRecord(0, 1, 3)
    mirror._pair()
    assert mirror.pairs == {}
    assert calls == [(0, MirrorForget())], "0 mirrors nowhere now (its dead buddy is sent nothing)"
    assert "s" not in mirror.records


def test_a_living_source_s_old_buddy_lets_go_when_the_pairs_change():
    mirror, calls = control_of(instance(0, "a"), instance(1, "b"))
    mirror._pair()
    assert mirror.pairs == {0: 1, 1: 0}
    mirror.fleet.instances.append(instance(2, "c"))  # a new instance joins
    mirror._pair()
    assert mirror.pairs == {0: 1, 1: 2, 2: 0}
    assert calls == [(0, MirrorRelease(1))], "1 mirrors to 2 now: 0 lets go of what it held of 1"
