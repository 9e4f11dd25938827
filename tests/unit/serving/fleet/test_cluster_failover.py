"""The front end's failover policy against fake instance drivers over pipes (no processes): a
request whose instances keep dying is quarantined after --max-request-failovers, the others go
on, --max-instances bounds scale-up, --max-ranks bounds every start (admin, restart, auto-restart)
before anything starts, and nothing per request is held once requests end."""

from __future__ import annotations

import asyncio
import threading
from multiprocessing import Pipe

import pytest

from dist_infer.engine.request import RequestOutput
from dist_infer.engine.sampling import SamplingParams
from dist_infer.serving.fleet.cluster import AdminError, Cluster, FleetConfig, InstanceClient
from dist_infer.serving.fleet.instance_specs import InstanceSpec
from dist_infer.serving.fleet.interface import EngineDeadError
from dist_infer.serving.fleet.wire import (
    AddRequest,
    Hello,
    InstanceDead,
    InstanceState,
    ResumeRequest,
    StepOutputs,
    StopInstance,
)
from tests.support.polling import wait_until

POISON = [7, 7, 7]  # the prompt that "crashes" whichever fake instance runs it
VANISH = [8, 8, 8]  # the first instance to run this vanishes without a word (its node lost: the connection drops)
VANISHED: set[str] = set()  # requests that made an instance vanish already (taken over, they run)


def _hello(index: int) -> Hello:
    return Hello.from_fields(
        index=index,
        tp=1,
        pp=1,
        role="mixed",
        total_blocks=64,
        block_size=4,
        max_positions=256,
        vocab_size=100,
        block_bytes=1024,
        cp=1,
        pids=[],
        addresses=[],
    )


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
                case (
                    AddRequest(request_id=request_id, prompt_token_ids=prompt)
                    | ResumeRequest(request_id=request_id, prompt_token_ids=prompt)
                ):
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
                    self.end.send(
                        StepOutputs([RequestOutput(request_id, ids, [0.0] * len(ids), [], "", True, "length")])
                    )
                case StopInstance():
                    self.end.close()
                    return


def _cluster(count: int, spawner=None, rank_capacity=None, **config) -> tuple[Cluster, list[FakeDriver]]:
    drivers = [FakeDriver(i) for i in range(count)]
    clients = [InstanceClient(i, d.api_end, _hello(i)) for i, d in enumerate(drivers)]
    cluster = Cluster(
        clients,
        "fake",
        config=FleetConfig(migrate_interval=0, dispatch="rr", **config),
        spawner=spawner,
        rank_capacity=rank_capacity,
    )
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


def test_an_instance_always_has_its_spec():
    """Given, or read from its driver's hello (a driver joining as a new index); never neither."""
    assert InstanceClient(0, spec=InstanceSpec(2, 1, "decode")).spec == InstanceSpec(2, 1, "decode")
    joining = InstanceClient(1, hello=_hello(1))
    assert joining.spec == InstanceSpec(1, 1, "mixed") and joining.state is InstanceState.STARTING
    with pytest.raises(TypeError, match="spec"):
        InstanceClient(2)


def test_a_driver_joining_as_the_next_index_adds_an_instance_that_serves():
    cluster, drivers = _cluster(1)
    try:
        joined = FakeDriver(1)
        cluster.attach(joined.api_end, _hello(1))
        assert [c.state for c in cluster.instances] == [InstanceState.SERVING] * 2
        assert cluster.instances[1].spec == InstanceSpec(1, 1, "mixed")
        assert [asyncio.run(_run(cluster, f"r{i}", [1, 2])) for i in range(2)] == [[3, 4, 5, 6]] * 2
        assert sorted(drivers[0].seen + joined.seen) == ["r0", "r1"] and joined.seen, "round robin reaches it"
    finally:
        cluster.stop(timeout=5)


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
        self._killed = threading.Event()

    @property
    def killed(self) -> bool:
        return self._killed.is_set()

    def poll(self):
        return -9 if self.killed else None

    def wait(self, timeout=None):
        import subprocess

        if not self._killed.wait(timeout or 0):
            raise subprocess.TimeoutExpired("fake job", timeout)
        return -9

    def kill(self):
        self._killed.set()

    terminate = kill


def test_auto_restart_places_a_dead_instance_again_and_the_last_one_s_death_ends_nothing():
    """--auto-restart: the only instance's driver goes away (its node lost): the server does not stop,
    the spawner starts it again, and once its new driver joins it serves."""

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
        wait_until(
            lambda: cluster.instances[0].state == InstanceState.SERVING and spawned,
            10,
            lambda: str(cluster.instances[0].describe()),
        )
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
        wait_until(lambda: cluster.instances[1].state == InstanceState.DEAD, 10, "instance 1 dead")
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


def _admin(cluster, method: str, path: str, **kw):
    """One admin request to the cluster's routes in-process, from 127.0.0.1 (admin without a key)."""
    import httpx
    from fastapi import FastAPI

    from dist_infer.serving.http.admin_routes import add_admin_routes

    app = FastAPI()
    add_admin_routes(app, cluster)

    async def go():
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as h:
            return await h.request(method, path, **kw)

    return asyncio.run(go())


def _recording_spawner(started: list):
    """A spawner that lists what it started, as (index, layout, job); its jobs run until killed."""

    def spawn(index, spec):
        started.append((index, spec.describe(), FakeJob()))
        return started[-1][2]

    return spawn


def _stop(cluster, started: list) -> None:
    for _, _, job in started:
        job.kill()  # jobs that never join: their start fails at once, the stop does not wait for them
    cluster.stop(timeout=5)


def test_admin_scale_up_past_max_ranks_gets_400_naming_it_and_starts_nothing():
    import psutil

    from dist_infer.serving.placement.rank_budget import RankBudget

    started = []
    cluster, _ = _cluster(2, spawner=_recording_spawner(started), rank_capacity=lambda: RankBudget(8))
    children = len(psutil.Process().children(recursive=True))
    try:
        r = _admin(cluster, "POST", "/admin/instances", json={"layout": "tp=99999"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "layout tp=99999 needs 99999 ranks; --max-ranks is 8 (2 running)"
        long = _admin(cluster, "POST", "/admin/instances", json={"layout": "tp1," * 100_000})
        assert long.status_code == 400 and "--max-ranks" in long.json()["error"]["message"], long.text[:300]
        assert started == [] and len(cluster.instances) == 2, "refused before any instance was made or started"
        assert len(psutil.Process().children(recursive=True)) == children, "no process was spawned"
        assert _admin(cluster, "GET", "/admin/instances").json()["ranks"] == {
            "running": 2,
            "max": 8,
            "origin": "--max-ranks",
        }
    finally:
        cluster.stop(timeout=5)


def test_ranks_starting_count_and_a_start_that_fits_later_gets_409():
    from dist_infer.serving.placement.rank_budget import RankBudget

    started = []
    cluster, _ = _cluster(
        2, spawner=_recording_spawner(started), rank_capacity=lambda: RankBudget(5), join_timeout_s=30
    )
    try:
        assert _admin(cluster, "POST", "/admin/instances", json={"layout": "tp=2"}).status_code == 202
        assert cluster.instances[2].state == InstanceState.STARTING and cluster.ranks_held() == 4
        r = _admin(cluster, "POST", "/admin/instances", json={"layout": "tp=2"})  # 2 + 2 starting + 2 > 5
        assert r.status_code == 409, r.text
        assert r.json()["error"]["message"] == "layout tp=2 needs 2 ranks; --max-ranks is 5 (4 running)"
        assert _admin(cluster, "POST", "/admin/instances", json={"layout": "tp=1"}).status_code == 202
        assert [s[:2] for s in started] == [(2, "tp=2"), (3, "tp=1")] and len(cluster.instances) == 4
    finally:
        _stop(cluster, started)


def test_a_restart_past_max_ranks_is_refused_by_the_operator_and_by_auto_restart():
    """A dead instance's ranks are free: another instance may take them, and then neither an operator's
    restart nor --auto-restart starts the dead one (the budget is asked at each start: a Ray cluster
    that lost a node has fewer ranks)."""
    from dist_infer.serving.placement.rank_budget import RankBudget

    started, limit = [], {"now": 2}
    cluster, _ = _cluster(
        2, spawner=_recording_spawner(started), rank_capacity=lambda: RankBudget(limit["now"]), join_timeout_s=30
    )
    try:
        asyncio.run(_run(cluster, "r0", [1, 2]))  # rr: the next goes to instance 1, which vanishes
        assert asyncio.run(_run(cluster, "lost-budget", VANISH)) == [9, 10, 11, 12]
        wait_until(lambda: cluster.instances[1].state == InstanceState.DEAD, 10, "instance 1 dead")
        assert _admin(cluster, "POST", "/admin/instances", json={"layout": "tp=1"}).status_code == 202
        r = _admin(cluster, "POST", "/admin/instances/1/restart")
        assert r.status_code == 409 and "--max-ranks is 2 (2 running)" in r.json()["error"]["message"], r.text
        assert cluster.instances[1].state == InstanceState.DEAD and [s[:2] for s in started] == [(2, "tp=1")]
    finally:
        _stop(cluster, started)

    started = []
    cluster, _ = _cluster(
        1, spawner=_recording_spawner(started), auto_restart=True, rank_capacity=lambda: RankBudget(limit["now"])
    )
    limit["now"] = 0  # the node went with the instance: no rank left anywhere
    try:
        out = asyncio.run(asyncio.wait_for(_run(cluster, "lost-budget-2", VANISH), timeout=10))
        assert isinstance(out, EngineDeadError), "the request parked for the restart ends, it does not wait"
        dead = cluster.instances[0]
        assert dead.state == InstanceState.DEAD and "needs 1 rank; --max-ranks is 0" in dead.dead, dead.dead
        assert started == [], "nothing was started"
    finally:
        cluster.stop(timeout=5)
