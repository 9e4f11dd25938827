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
