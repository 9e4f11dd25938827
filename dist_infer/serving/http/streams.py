"""One request's stream of deltas between the engine and an HTTP client.

EngineStream wraps the engine's generator with what every endpoint needs around it (the text,
read incrementally from the token ids with the stop strings checked there, the metrics clock,
and an abort if it ends before the engine finished it); EventStream sends it as
server-sent events and closes it however the response ends; until_disconnect turns a client
that goes away while a non-streamed answer is pending into ClientGone.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, AsyncGenerator, Awaitable, Optional, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from loguru import logger

from dist_infer.engine.request import RequestOutput
from dist_infer.engine.sampling import SamplingParams
from dist_infer.serving.fleet.interface import EngineDeadError
from dist_infer.serving.http.detokenizer import IncrementalDetokenizer, detokenize_output
from dist_infer.serving.http.metrics import RequestClock

if TYPE_CHECKING:
    from dist_infer.serving.http.state import ServingState

T = TypeVar("T")
DISCONNECT_POLL_S = 0.25  # how often a pending non-streamed request checks that its client is still there
SSE_DONE = "data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed its connection while its answer was being made."""


def sse(data: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class EngineStream:
    """One request's deltas from the engine, with what every endpoint needs around them: their
    text (the engine sends token ids only), the metrics clock fed on each delta, and an abort if
    it ends before the engine finished it (a client gone, or a stop string the engine cannot see)."""

    def __init__(
        self, state: "ServingState", request_id: str, prompt_ids: list[int], params: SamplingParams, clock: RequestClock
    ):
        self.state = state
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.clock = clock
        self.finished = False
        self.closed = False
        tokenizer = state.tokenizer
        self.detok = (
            IncrementalDetokenizer(tokenizer, params.stop, params.min_tokens) if tokenizer is not None else None
        )
        self._gen = state.engine.generate(request_id, prompt_ids, params)

    async def next(self) -> Optional[RequestOutput]:
        """The next delta; None after the finished one. A generator that ends without a finished
        delta reads as an abort."""
        if self.finished:
            return None
        try:
            out = await self._gen.__anext__()
        except StopAsyncIteration:
            out = RequestOutput(
                self.request_id, [], [], [], "", True, "abort", None, len(self.prompt_ids), self.clock.num_generated
            )
        except Exception:
            self.finished = True  # raised by the engine (queue full, dead): nothing of it is left to abort
            self.state.active.pop(self.request_id, None)
            raise
        engine_done = out.finished
        if self.detok is not None:
            out = detokenize_output(self.detok, out)
        self.clock.on_output(out)
        if out.error:
            self.finished = True
            self.clock.on_end("error")
            raise EngineDeadError(out.error)
        if out.finished:
            self.finished = True
            if not engine_done:  # a stop string ended it here: the engine still runs it
                self.state.engine.abort(self.request_id)
            self.clock.on_end(out.finish_reason)
            self.state.active.pop(self.request_id, None)
        return out

    async def collect(self) -> list[RequestOutput]:
        outputs = []
        while (out := await self.next()) is not None:
            outputs.append(out)
        return outputs

    async def close(self) -> None:
        """End it: abort in the engine if unfinished (first, synchronously, so even a cancelled
        close frees the KV blocks), then close the engine's generator."""
        if self.closed:
            return
        self.closed = True
        self.state.active.pop(self.request_id, None)
        if not self.finished:
            self.finished = True
            self.state.engine.abort(self.request_id)
            self.clock.on_end("abort")
            logger.info(f"request {self.request_id} aborted: its client went away or the server is stopping")
        try:
            await self._gen.aclose()
        except Exception as exc:  # noqa: BLE001 - the request is over either way
            logger.debug(f"closing the stream of {self.request_id}: {exc}")


async def close_shielded(stream: EngineStream) -> None:
    with anyio.CancelScope(shield=True):
        await stream.close()


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable` while checking that the client is still connected; ClientGone if not."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({task})


class EventStream(StreamingResponse):
    """Server-sent events whose engine request is closed however the stream ends: finished,
    the client gone (Starlette cancels the sender), or the server cancelling it at shutdown."""

    def __init__(self, events: AsyncGenerator[str, None], stream: EngineStream, headers: dict[str, str]):
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )
        self.events = events  # (Starlette's body_iterator, typed there as any async iterable)
        self.engine_stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.events.aclose()
                await self.engine_stream.close()
