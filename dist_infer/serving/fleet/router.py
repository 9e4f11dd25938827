"""Where each request goes among the fleet's instances: the dispatch policy
(serving/fleet/dispatch.py) applied to the instances' loads, counted the moment a request is
sent so that a burst between two load reports spreads out."""

from __future__ import annotations

from typing import Optional

from dist_infer.engine.sampling import SamplingParams
from dist_infer.serving.fleet.dispatch import Dispatcher
from dist_infer.serving.fleet.fleet_state import FleetState
from dist_infer.serving.fleet.instance_record import InstanceClient
from dist_infer.serving.fleet.interface import QueueFullError
from dist_infer.serving.fleet.prefix_index import prompt_block_hashes
from dist_infer.serving.fleet.wire import Role


class Router:
    def __init__(self, fleet: FleetState, dispatcher: Dispatcher):
        self.fleet, self.dispatcher = fleet, dispatcher

    def choose(
        self,
        prompt_len: int,
        params: SamplingParams,
        roles: tuple[str, ...],
        force: bool = False,
        queued: bool = True,
        hashes: tuple[int, ...] = (),
        prefer: Optional[int] = None,
    ) -> Optional[int]:
        """The instance for a request (with the lock held): among those accepting, the ones of the
        roles asked for (any, if none of them accepts); `force`: if none has room, still the least
        loaded (it queues there). `queued`: it arrives as an add the instance will count. `hashes`:
        the block hashes of what it will compute there (prompt_hashes), which the `prefix` policy
        looks up in each instance's prefix cache. `prefer`: this instance if it accepts (the one
        holding a failed-over request's KV mirror)."""
        need = self.fleet.blocks_at_full_length(prompt_len, params.max_new_tokens)
        accepting = [c for c in self.fleet.instances if c.accepting]
        pool = [c for c in accepting if c.role in roles] or accepting
        loads = [c.load(hashes) for c in pool]
        if prefer is not None and self.fleet.instances[prefer].accepting:
            index: Optional[int] = prefer
        else:
            index = self.dispatcher.choose(loads, need, len(hashes))
        if index is None and force and loads:
            index = max(loads, key=lambda x: (x.freeness, -x.index)).index
        if index is not None and queued:
            self.fleet.instances[index].expect_add(need, hashes)
        return index

    def prompt_hashes(self, tokens: list[int], params: SamplingParams) -> tuple[int, ...]:
        """The block hashes the `prefix` dispatch looks up, salted with the request's cache salt as
        the instance salts them (none for the other policies); computed before the lock is taken (a
        long prompt hashes for a while)."""
        if self.dispatcher.policy != "prefix":
            return ()
        return tuple(prompt_block_hashes(tokens, self.fleet.block_size, params.cache_salt))

    def dispatch(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> InstanceClient:
        """The instance a new request goes to, made its owner; QueueFullError if none can take it."""
        hashes = self.prompt_hashes(prompt_token_ids, params)
        with self.fleet.lock:
            index = self.choose(len(prompt_token_ids), params, (Role.PREFILL, Role.MIXED), hashes=hashes)
            if index is None:
                raise QueueFullError(retry_after_s=5.0)
            self.fleet.requests[request_id].owner = index
        return self.fleet.instances[index]
