"""What every part of the fleet shares, in one object passed to each: the instances, the one
record per request, the lock that guards both, the model's shape as the first instance reported
it, and where the server is in its life (accepting, stopping, dead)."""

from __future__ import annotations

import threading
from typing import Optional

from dist_infer.engine.block_demand import blocks_at_full_length
from dist_infer.serving.fleet.instance_record import InstanceClient, RequestRecord
from dist_infer.serving.fleet.wire import AbortRequest, InstanceState

# hold ranks; the server goes on while one instance is in one of these
LIVING = (InstanceState.SERVING, InstanceState.STOPPING, InstanceState.STARTING)


class FleetState:
    """The instances and the requests (guarded by `lock`, a re-entrant lock: a part holding it may
    call another that takes it), and the server's flags."""

    def __init__(self, clients: list[InstanceClient]):
        first = clients[0].hello
        if first is None:
            raise ValueError("FleetState: its first instance has not joined (no hello says the model's shape)")
        self.instances = clients
        self.requests: dict[str, RequestRecord] = {}
        self.lock = threading.RLock()
        self.max_model_len, self.vocab_size = first.max_positions, first.vocab_size
        self.block_size, self.block_bytes = first.block_size, first.block_bytes
        self.cp = first.cp
        self.accepting = True  # new requests are taken (false once the server shuts down)
        self.stopping = False  # stop() was called: connections that close are no deaths
        self.dead_reason: Optional[str] = None  # why no instance is left (the server stops)

    def blocks_at_full_length(self, prompt_len: int, max_new_tokens: int) -> int:
        """KV blocks a request holds at its full length on any instance of this model."""
        return blocks_at_full_length(prompt_len, max_new_tokens, self.block_size, self.cp)

    def any_starting(self) -> bool:
        return any(c.state == InstanceState.STARTING for c in self.instances)

    def unpark(self) -> list[str]:
        """(lock held) The requests waiting for an instance to start; they are dispatched again."""
        parked = [r for r, rec in self.requests.items() if rec.parked]
        for r in parked:
            self.requests[r].parked = False
        return parked

    def num_queued(self) -> int:
        """Requests held that no instance reports running (the --max-queue bound)."""
        with self.lock:
            open_streams = len(self.requests)
        running = sum(c.stats.num_requests_running for c in self.instances if c.alive)
        return max(0, open_streams - running)

    def abort_on(self, index: int, request_id: str) -> None:
        """End a request on one instance, whatever the API's routing says (a late copy of it), and
        stream nothing more from it there."""
        with self.lock:
            rec = self.requests.get(request_id)
            if rec is not None and rec.moving is not None and rec.moving[1] == index:
                rec.moving = (rec.moving[0], -1)
        if self.instances[index].alive:
            try:
                self.instances[index].send(AbortRequest(request_id))
            except OSError:
                pass
