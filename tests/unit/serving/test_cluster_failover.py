"""The front end's failover policy against fake instance drivers over pipes (no processes): a
request whose instances keep dying is quarantined after --max-request-failovers, the others go
on, --max-instances bounds scale-up, and nothing per request is held once requests end."""

from __future__ import annotations

import asyncio
import threading
from multiprocessing import Pipe

import pytest

from dist_infer.engine.request import RequestOutput
from dist_infer.engine.sampling import SamplingParams
from dist_infer.serving.cluster import AdminError, Cluster, InstanceClient
from dist_infer.serving.errors import EngineDeadError
from dist_infer.serving.wire import (AddRequest, Hello, InstanceDead, InstanceState, ResumeRequest, StepOutputs,
                                     StopInstance)

POISON = [7, 7, 7]  # the prompt that "crashes" whichever fake instance runs it
VANISH = [8, 8, 8]  # the first instance to run this vanishes without a word (its node lost: the connection drops)
VANISHED: set[str] = set()  # requests that made an instance vanish already (taken over, they run)


def _hello(index: int) -> Hello:
    return Hello.from_fields(index=index, tp=1, pp=1, role="mixed", total_blocks=64, block_size=4, max_positions=256,
                             vocab_size=100, block_bytes=1024, cp=1, pids=[], addresses=[])


class FakeDriver:
    """Answers each add/resume with its tokens (the prompt's last id + 1, 2, ...), or dies on POISON."""

    def __init__(self, index: int):
        self.index = index
        self.api_end, self.end = Pipe()
        self.seen: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                message = self.end.recv()
            except (EOFError, OSError):
                return
            match message:
                case AddRequest(request_id=request_id, prompt_token_ids=prompt) | \
                        ResumeRequest(request_id=request_id, prompt_token_ids=prompt):
                    self.seen.append(request_id)
                    if prompt == VANISH and request_id not in VANISHED:
                        VANISHED.add(request_id)
                        self.end.close()
                        return
                    if prompt == POISON:
                        self.end.send(InstanceDead(f"fake instance {self.index} crashed on {request_id}"))
                        self.end.close()
                        return
                    have = len(message.progress.token_ids) if isinstance(message, ResumeRequest) else 0
                    ids = [prompt[-1] + i + 1 for i in range(have, message.params.max_new_tokens)]
                    self.end.send(StepOutputs([RequestOutput(request_id, ids, [0.0] * len(ids), [], "", True, "length")]))
                case StopInstance():
                    self.end.close()
                    return


def _cluster(count: int, **kwargs) -> tuple[Cluster, list[FakeDriver]]:
    drivers = [FakeDriver(i) for i in range(count)]
    clients = [InstanceClient(i, d.api_end, _hello(i)) for i, d in enumerate(drivers)]
    cluster = Cluster(clients, "fake", migrate_interval=0, dispatch="rr", **kwargs)
    cluster.start()
    return cluster, drivers


async def _run(cluster: Cluster, request_id: str, prompt: list[int]):
    out = []
    try:
        async for item in cluster.generate(request_id, prompt, SamplingParams(max_new_tokens=4)):
            out += item.new_token_ids
    except EngineDeadError as exc:
        return exc
    return out


def test_a_poison_request_is_quarantined_after_max_failovers_and_the_rest_serve_on():
    cluster, drivers = _cluster(4, max_request_failovers=1)
    try:
        async def go():
            poison = await _run(cluster, "poison", POISON)
            fine = await asyncio.gather(*(_run(cluster, f"r{i}", [1, i]) for i in range(6)))
            return poison, fine

        poison, fine = asyncio.run(go())
        assert isinstance(poison, EngineDeadError) and "--max-request-failovers 1" in str(poison), poison
        assert cluster.requests_quarantined == 1
        assert sum("poison" in d.seen for d in drivers) == 2  # two instances died of it, then it stopped walking
        assert [c.state for c in cluster.instances].count(InstanceState.DEAD) == 2
        assert fine == [[i + 1, i + 2, i + 3, i + 4] for i in range(6)]  # the others serve on, on what is left
        assert all(v == 0 for v in cluster.held().values()), cluster.held()
        assert cluster.stats()["requests_quarantined_total"] == 1
    finally:
        cluster.stop(timeout=5)


def test_zero_failovers_fails_the_request_at_the_first_death():
    cluster, drivers = _cluster(3, max_request_failovers=0)
    try:
        poison = asyncio.run(_run(cluster, "poison", POISON))
        assert isinstance(poison, EngineDeadError)
        assert sum("poison" in d.seen for d in drivers) == 1
    finally:
        cluster.stop(timeout=5)


def test_scale_up_is_bounded_by_max_instances():
    cluster, _ = _cluster(2, max_instances=2, spawner=lambda index, spec: pytest.fail("nothing may start"))
    try:
        with pytest.raises(AdminError, match="--max-instances 2") as err:
            cluster.add_instance("tp1")
        assert err.value.status == 409 and len(cluster.instances) == 2
    finally:
        cluster.stop(timeout=5)


class FakeJob:
    """What a spawner returns: a job that runs until killed."""

    def __init__(self):
        self.killed = False

    def poll(self):
        return -9 if self.killed else None

    def wait(self, timeout=None):
        import subprocess
        import time

        deadline = time.monotonic() + (timeout or 0)
        while not self.killed and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.killed:
            raise subprocess.TimeoutExpired("fake job", timeout)
        return -9

    def kill(self):
        self.killed = True

    terminate = kill


def test_auto_restart_places_a_dead_instance_again_and_the_last_one_s_death_ends_nothing():
    """--auto-restart: the only instance's driver goes away (its node lost): the server does not stop,
    the spawner starts it again, and once its new driver joins it serves."""
    import time

    spawned, jobs = [], []

    def spawner(index, spec):
        spawned.append(index)
        jobs.append(FakeJob())
        driver = FakeDriver(index)
        threading.Timer(0.2, lambda: cluster.attach(driver.api_end, _hello(index))).start()
        return jobs[-1]

    cluster, drivers = _cluster(1, spawner=spawner, auto_restart=True)
    cluster.instances[0].process = first = FakeJob()
    try:
        assert asyncio.run(_run(cluster, "before", [1, 2])) == [3, 4, 5, 6]
        lost = asyncio.run(_run(cluster, "lost-1", VANISH))  # its node is gone mid-request: the connection drops
        deadline = time.monotonic() + 10
        while cluster.instances[0].state != InstanceState.SERVING or not spawned:
            assert time.monotonic() < deadline, cluster.instances[0].describe()
            time.sleep(0.02)
        assert cluster.dead_reason is None and spawned == [0] and first.killed, "the dead job was cleaned up"
        assert cluster.instances[0].restarts == 1 and cluster.instances[0].auto_restarts == 0
        assert lost == [9, 10, 11, 12], "the request went on on the restarted instance"
        assert asyncio.run(_run(cluster, "after", [1, 5])) == [6, 7, 8, 9]
    finally:
        cluster.stop(timeout=5)


def test_without_auto_restart_a_dead_instance_stays_dead():
    cluster, drivers = _cluster(2, spawner=lambda index, spec: pytest.fail("nothing may start"))
    try:
        asyncio.run(_run(cluster, "r0", [1, 2]))  # rr: the next goes to instance 1
        assert asyncio.run(_run(cluster, "lost-2", VANISH)) == [9, 10, 11, 12], "it went on on instance 0"
        import time

        deadline = time.monotonic() + 10
        while cluster.instances[1].state != InstanceState.DEAD:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert cluster.instances[0].state == InstanceState.SERVING
    finally:
        cluster.stop(timeout=5)


def test_a_failed_automatic_restart_ends_the_requests_that_waited_for_it():
    """The last instance vanishes and its restart cannot even start (no node has room): the request
    parked for the restart ends with an error its client sees; it does not wait forever."""
    def spawner(index, spec):
        raise RuntimeError("no Ray node had room")

    cluster, _ = _cluster(1, spawner=spawner, auto_restart=True)
    try:
        out = asyncio.run(asyncio.wait_for(_run(cluster, "lost-3", VANISH), timeout=10))
        assert isinstance(out, EngineDeadError), out
        assert cluster.instances[0].state == InstanceState.DEAD and "no Ray node had room" in cluster.instances[0].dead
    finally:
        cluster.stop(timeout=5)
