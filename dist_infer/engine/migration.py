"""One instance's side of a live request migration, on its driver (the step loop's thread).

The serving layer's orchestrator (serving/migration/live_migration.py) calls these between steps, in this
order, and every call answers through `reply(result)` or `reply(exception)`:

    source                                  destination
    start_out(m, request_id, peer)          reserve_in(m, peer, blocks, hashes) -> held
    send_out(m, stage, held) -> (first, count)   recv_in(m, stage, first, count)  } a few stages
    ... each side reports (m, stage) done through `notify` once its own transfers are out ...
    pause_out(m, stage, send_kv, held) -> (MigratingRequest, first, count)   (once it is paused)
                                            recv_in(...) for the rest, then commit_in(m, state)
    release_out(m)   (or resume_out(m) if the commit failed)      cancel_in(m) on any failure

While the stages run the request keeps decoding on the source; only between pause_out and
commit_in is it stopped (the downtime). A stage sends only blocks that are full, which never
change again; the pause sends the rest. The destination first claims the leading blocks its
prefix cache already holds (matched by the block hashes start_out reports; they are the same keys
and values, prefix_cache.py), and the source starts sending after them: a request whose prefix
the destination has computed moves only its own tail. If the request ends on the source (finished, aborted,
preempted) before it is paused, the next call raises MigrationAborted and the request ends or
stays where it is. The destination's reserved blocks are its own until commit or cancel;
nothing is freed twice, nothing leaks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable, Optional, Sequence

from dist_infer.engine.block_pool import CacheFullError
from dist_infer.engine.kv_cache import blocks_for
from dist_infer.engine.kv_transfer import PeerInstance, TransferOp
from dist_infer.engine.mirror import MirrorSource, MirrorStore
from dist_infer.engine.request import Request, RequestStatus
from dist_infer.engine.sampling import SamplingParams

Reply = Callable[[object], None]


class MigrationOutcome(StrEnum):
    """How a migration ended, in a word (the migrations_total label; str-valued, so the same strings)."""

    OK = "ok"
    NOT_FOUND = "not_found"
    BUSY = "busy"
    NO_ROOM = "no_room"
    SOURCE_ENDED = "source_ended"
    SOURCE_PREEMPTED = "source_preempted"
    SOURCE_FAILED = "source_failed"
    DEST_FAILED = "dest_failed"
    TRANSFER_FAILED = "transfer_failed"
    INSTANCE_DIED = "instance_died"
    CANCELLED = "cancelled"
    ERROR = "error"


class MigrationAborted(RuntimeError):
    """The migration cannot go on; `outcome` says why in a word (the migrations_total label)."""

    def __init__(self, outcome: str, message: str):
        super().__init__(message)
        self.outcome = MigrationOutcome(outcome)


@dataclass(frozen=True)
class MigratingRequest:
    """What a migration carries to the destination: exactly what it needs to run the request on
    (no block table, no logits, nothing in flight, no text: the front end detokenizes), times as
    ages (clocks differ by host). The wire format is this, not the engine's in-memory Request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int]
    output_logprobs: list[float]
    output_top_logprobs: list
    num_computed: int
    num_preemptions: int
    age_s: float
    first_token_age_s: Optional[float]
    emitted_tokens: int

    @classmethod
    def of(cls, r: Request, send_kv: bool = True) -> "MigratingRequest":
        """The paused request `r`; without `send_kv` nothing is computed (the destination prefills)."""
        now = time.monotonic()
        return cls(
            r.request_id,
            list(r.prompt_token_ids),
            r.params,
            r.seed,
            list(r.output_token_ids),
            list(r.output_logprobs),
            list(r.output_top_logprobs),
            r.num_computed if send_kv else 0,
            r.num_preemptions,
            now - r.arrival_time,
            None if r.first_token_time is None else now - r.first_token_time,
            r.emitted_tokens,
        )

    def to_request(self) -> Request:
        """The destination's Request (its seq id and blocks are the engine's to give)."""
        now = time.monotonic()
        return Request(
            self.request_id,
            list(self.prompt_token_ids),
            self.params,
            self.seed,
            arrival_time=now - self.age_s,
            output_token_ids=list(self.output_token_ids),
            output_logprobs=list(self.output_logprobs),
            output_top_logprobs=list(self.output_top_logprobs),
            status=RequestStatus.MIGRATING,
            num_computed=self.num_computed,
            num_preemptions=self.num_preemptions,
            first_token_time=None if self.first_token_age_s is None else now - self.first_token_age_s,
            emitted_tokens=self.emitted_tokens,
        )


@dataclass
class _Out:
    request: Request
    peer: PeerInstance
    preemptions: int  # the request's count at the start: one more and the sent blocks are stale
    sent: int = 0  # blocks of the table already sent
    stages: set = field(default_factory=set)  # stages whose sends are still out
    pause_reply: Optional[Reply] = None
    pause_stage: int = 0
    paused: bool = False
    send_kv: bool = True


@dataclass
class _In:
    peer: PeerInstance
    blocks: list[int]
    stages: set = field(default_factory=set)


class MigrationEndpoint:
    """The driver's migrations in and out; `notify(event, *args)` tells the orchestrator that a
    stage's transfers are out (this rank's share) or that a migration died on its own."""

    def __init__(self, engine, notify: Callable[..., None]):
        self.engine = engine
        self.notify = notify
        self._out: dict[int, _Out] = {}
        self._in: dict[int, _In] = {}
        self._committed: deque[int] = deque(maxlen=4096)  # recent migrations taken over here
        # KV mirroring's two sides (engine/mirror/); they report through `notify` as it is then
        self.mirror_out = MirrorSource(engine, lambda *event: self.notify(*event))
        self.mirror_in = MirrorStore(engine, lambda *event: self.notify(*event))

    @property
    def scheduler(self):
        return self.engine.scheduler

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    # -- source --------------------------------------------------------------------------------
    def start_out(self, mid: int, request_id: str, peer: PeerInstance, reply: Reply) -> None:
        r = self.engine.find(request_id)
        if r is None or r.finished:
            return reply(MigrationAborted("not_found", f"request {request_id} is not on this instance"))
        if any(o.request is r for o in self._out.values()):
            return reply(MigrationAborted("busy", f"request {request_id} is already migrating"))
        self._out[mid] = _Out(r, peer, r.num_preemptions)
        hashes = self.scheduler.computed_block_hashes(r) if r.status is RequestStatus.RUNNING else []
        reply(
            {
                "blocks": len(r.block_table),
                "num_tokens": r.num_tokens,
                "running": r.status is RequestStatus.RUNNING,
                "hashes": hashes,
            }
        )

    def _live(self, mid: int) -> _Out:
        out = self._out.get(mid)
        if out is None:
            raise MigrationAborted("source_ended", f"migration {mid} is not known on the source")
        r = out.request
        if r.finished:
            self._out.pop(mid)
            raise MigrationAborted("source_ended", f"request {r.request_id} ended on the source ({r.finish_reason})")
        if r.num_preemptions != out.preemptions:
            self._out.pop(mid)
            raise MigrationAborted("source_preempted", f"request {r.request_id} was preempted on the source")
        return out

    def _queue_send(self, mid: int, out: _Out, stage: int, upto: int) -> tuple[int, int]:
        first, count = out.sent, upto - out.sent
        if count > 0:
            self.engine.queue_transfer(
                TransferOp(TransferOp.SEND, mid, stage, out.peer, out.request.block_table[first:upto])
            )
            out.stages.add(stage)
        else:
            self.notify("stage_done", mid, stage)
        out.sent = max(out.sent, upto)
        return first, max(0, count)

    def send_out(self, mid: int, stage: int, held: int = 0, *, reply: Reply) -> None:
        """Send the blocks that filled up since the last stage (the request goes on decoding); the
        first `held` blocks the destination has already (its prefix cache) are never sent."""
        try:
            out = self._live(mid)
        except MigrationAborted as exc:
            return reply(exc)
        r = out.request
        out.sent = max(out.sent, held)
        full = r.num_computed // self.block_size if r.status is RequestStatus.RUNNING else 0
        reply(self._queue_send(mid, out, stage, full))

    def pause_out(self, mid: int, stage: int, send_kv: bool = True, held: int = 0, *, reply: Reply) -> None:
        """Stop scheduling the request (once its sampled token is back), send what is left, and
        answer with the request's state. Without `send_kv` nothing is sent and the state says
        nothing is computed: the destination recomputes the KV (the baseline live migration beats)."""
        try:
            out = self._live(mid)
        except MigrationAborted as exc:
            return reply(exc)
        out.pause_reply, out.pause_stage, out.send_kv = reply, stage, send_kv
        out.sent = max(out.sent, held)
        self.poll()

    def _finish_pause(self, mid: int, out: _Out) -> None:
        r = out.request
        self.scheduler.pause(r)
        out.paused = True
        reply, out.pause_reply = out.pause_reply, None
        state = MigratingRequest.of(r, out.send_kv)
        if not out.send_kv:
            return reply((state, 0, 0))
        first, count = self._queue_send(mid, out, out.pause_stage, blocks_for(r.num_computed, self.block_size))
        reply((state, first, count))

    def release_out(self, mid: int, reply: Reply) -> None:
        """The destination has it: free it here, without a word to the client (it streams on)."""
        out = self._out.pop(mid, None)
        if out is not None and not out.request.finished:
            self.engine.hand_over(out.request)
        reply(True)

    def resume_out(self, mid: int, reply: Reply) -> None:
        """The migration failed: the request goes on here (if it was paused, from where it stopped)."""
        out = self._out.pop(mid, None)
        if out is not None and out.paused and not out.request.finished:
            self.scheduler.resume(out.request)
        elif out is not None and out.pause_reply is not None:
            out.pause_reply(MigrationAborted("cancelled", f"migration {mid} was cancelled"))
        reply(True)

    # -- destination ---------------------------------------------------------------------------
    def reserve_in(
        self, mid: int, peer: PeerInstance, num_blocks: int, hashes: Sequence[int] = (), *, reply: Reply
    ) -> None:
        """Hold `num_blocks` blocks for the request: first the leading ones this instance's prefix
        cache has under the request's block `hashes` (taken, so they are not evicted), then new
        ones. Answers how many leading blocks it already holds: the source sends none of them."""
        s = self.scheduler
        pool = s.allocator
        held = pool.match(hashes[:num_blocks]) if num_blocks else []
        needed = num_blocks - len(held) + pool.reclaimed_by(held)  # allocatable blocks it uses up
        spare = s.num_free_blocks - s.watermark_blocks
        if needed > spare:
            return reply(
                MigrationAborted(
                    "no_room",
                    f"needs {needed} KV blocks, {max(0, spare)} are spare "
                    f"({s.num_free_blocks} free, watermark {s.watermark_blocks})",
                )
            )
        pool.take(held)
        self._in[mid] = _In(peer, held + [pool.allocate() for _ in range(num_blocks - len(held))])
        reply(len(held))

    def recv_in(self, mid: int, stage: int, first: int, count: int, reply: Reply) -> None:
        got = self._in.get(mid)
        if got is None:
            return reply(MigrationAborted("dest_failed", f"migration {mid} is not known on the destination"))
        if count > 0:
            if first + count > len(got.blocks):
                self._grow(got, first + count)
            self.engine.queue_transfer(
                TransferOp(TransferOp.RECV, mid, stage, got.peer, got.blocks[first : first + count])
            )
            got.stages.add(stage)
        else:
            self.notify("stage_done", mid, stage)
        reply(True)

    def _grow(self, got: _In, blocks: int) -> None:
        s = self.scheduler
        while len(got.blocks) < blocks:
            try:
                got.blocks.append(s.allocator.allocate())
            except CacheFullError:
                raise MigrationAborted(
                    "no_room", f"the destination ran out of KV blocks at {len(got.blocks)}"
                ) from None

    def commit_in(self, mid: int, state: MigratingRequest, reply: Reply) -> None:
        """Every rank waits for the blocks still on the way, then the request runs here."""
        got = self._in.get(mid)
        if got is None:
            return reply(MigrationAborted("dest_failed", f"migration {mid} is not known on the destination"))
        need = blocks_for(state.num_computed, self.block_size)
        request = state.to_request()
        try:
            self._grow(got, need)
            self._start_grammar(request)
        except MigrationAborted as exc:
            self._cancel(mid)
            return reply(exc)
        self._in.pop(mid)
        self._committed.append(mid)
        self.scheduler.allocator.free(got.blocks[need:])
        self.engine.queue_transfer(TransferOp(TransferOp.COMMIT, mid))
        self.engine.adopt(request, got.blocks[:need])
        reply(True)

    def _start_grammar(self, request: Request) -> None:
        """A structured request's grammar state, rebuilt here from its output ids before it is
        committed; MigrationAborted if that fails (the request stays on the source)."""
        if request.params.structured is None:
            return
        try:
            self.engine.start_grammar(request)
        except Exception as exc:  # noqa: BLE001 - a spec or output this instance cannot take
            raise MigrationAborted("dest_failed", f"its grammar cannot be rebuilt here: {exc}") from exc

    def cancel_in(self, mid: int, reply: Reply) -> None:
        """Let go of a migration's blocks; answers "committed" if it was already taken over (a
        commit whose answer came too late for the orchestrator), else True."""
        if mid in self._committed:
            return reply("committed")
        self._cancel(mid)
        reply(True)

    def _cancel(self, mid: int) -> None:
        got = self._in.pop(mid, None)
        if got is not None:
            self.engine.queue_transfer(TransferOp(TransferOp.CANCEL, mid))
            self.scheduler.allocator.free(got.blocks)

    # -- every step ----------------------------------------------------------------------------
    @property
    def failovers_may_arrive(self) -> bool:
        """This instance holds a long request's mirrored blocks: that stream may fail over here at any
        step, and its gap is then mostly the step in flight (mirror/entries.py LONG_REQUEST_TOKENS)."""
        return self.mirror_in.holds_long_request

    @property
    def busy(self) -> bool:
        return (
            any(o.stages or o.pause_reply for o in self._out.values())
            or any(i.stages for i in self._in.values())
            or self.mirror_out.busy
            or self.mirror_in.busy
        )

    def poll(self) -> None:
        """Report stages whose transfers are out; pause what waited for its sampled token; drop
        migrations whose request ended on the source."""
        mover = self.engine.mover

        def report(mid: int, stages: set) -> None:
            for stage in [s for s in stages if mover.stage_done(mid, s)]:
                stages.discard(stage)
                self.notify("stage_failed" if mid in mover.failures else "stage_done", mid, stage)

        for mid, out in list(self._out.items()):
            report(mid, out.stages)
            if out.pause_reply is not None:
                if out.request.finished:
                    reply, out.pause_reply = out.pause_reply, None
                    self._out.pop(mid, None)
                    reply(
                        MigrationAborted(
                            "source_ended",
                            f"request {out.request.request_id} ended on the source ({out.request.finish_reason})",
                        )
                    )
                elif not out.request.in_flight and out.request.layer_progress is None:
                    self._finish_pause(mid, out)  # (a layered prompt pauses after its last group)
        for mid, got in self._in.items():
            report(mid, got.stages)
        self.mirror_out.poll()
        self.mirror_in.poll()

    @property
    def reserved_blocks(self) -> int:
        return sum(len(i.blocks) for i in self._in.values())
