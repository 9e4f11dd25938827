"""Tiny fake OpenAI servers for bench-serve's runs (FastAPI + uvicorn in a thread on 127.0.0.1):
one that streams tokens like an OpenAI server (failing, stalling or ignoring "stream" on request),
one that remembers conversations, streams token ids like this project's server and counts prefix
cache hits on its /metrics; and `serving`, which runs either."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from typing import Callable, Optional

from fastapi import FastAPI, Request  # module level: the app's annotations must resolve here
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


def make_fake_server(fail_every: int = 0, usage: bool = True, stall_every: int = 0, stream: bool = True):
    """A FastAPI app that streams `max_tokens` tokens per request like an OpenAI server.

    Every 3rd chunk carries 2 tokens and says so with `token_ids` (as vLLM can); the others carry one
    token and no ids. With fail_every=k every k-th request gets HTTP 400; with stall_every=k every k-th
    hangs; with stream=False the whole answer comes as one JSON body (a server that ignores
    "stream": true). The returned `seen` dict
    records what the server received and sent, for the asserts."""
    app = FastAPI()
    seen = {"bodies": [], "sent": [], "rejected": 0, "in_flight": 0, "max_in_flight": 0}
    lock = threading.Lock()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}, {"id": "other"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        with lock:
            seen["bodies"].append(body)
            number = len(seen["bodies"])
            if fail_every and number % fail_every == 0:
                seen["rejected"] += 1
                return JSONResponse(
                    {
                        "error": {
                            "message": f"fake rejection of request {number}",
                            "type": "BadRequestError",
                            "code": 400,
                        }
                    },
                    status_code=400,
                )
            seen["in_flight"] += 1
            seen["max_in_flight"] = max(seen["max_in_flight"], seen["in_flight"])
        max_tokens = int(body["max_tokens"])
        prompt_tokens = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 3
        if stall_every and number % stall_every == 0:
            deadline = time.monotonic() + 60
            while not await request.is_disconnected() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # hang until the client gives up
            with lock:
                seen["in_flight"] -= 1
            return JSONResponse({"error": {"message": "client went away"}}, status_code=499)
        if not stream:
            with lock:
                seen["sent"].append(max_tokens)
                seen["in_flight"] -= 1
            return {
                "id": "x",
                "object": "text_completion",
                "model": body["model"],
                "choices": [{"index": 0, "text": " w" * max_tokens, "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": max_tokens,
                    "total_tokens": prompt_tokens + max_tokens,
                },
            }

        def chunk(text, ids=None, finish=None):
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            if ids is not None:
                choice["token_ids"] = ids
            return (
                "data: "
                + json.dumps({"id": "x", "object": "chunk", "model": body["model"], "choices": [choice], "usage": None})
                + "\n\n"
            )

        async def events():
            yield ": keep-alive\n\n"
            if chat:
                yield (
                    "data: "
                    + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                    + "\n\n"
                )
            sent = chunk_number = 0
            while sent < max_tokens:
                k = 2 if chunk_number % 3 == 2 and max_tokens - sent >= 2 else 1
                ids = list(range(100 + sent, 100 + sent + k))
                yield chunk("".join(f" w{i}" for i in ids), ids if k > 1 else None)
                sent += k
                chunk_number += 1
                await asyncio.sleep(0.001)
            yield chunk("", finish="length")
            if usage and body.get("stream_options", {}).get("include_usage"):
                yield (
                    "data: "
                    + json.dumps(
                        {
                            "choices": [],
                            "usage": {
                                "prompt_tokens": prompt_tokens,
                                "completion_tokens": sent,
                                "total_tokens": prompt_tokens + sent,
                            },
                        }
                    )
                    + "\n\n"
                )
            with lock:
                seen["sent"].append(sent)
                seen["in_flight"] -= 1  # before [DONE], so the client cannot start its next request first
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app, seen


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def make_chat_server(
    key: Callable[[dict], object],
    metrics: Optional[str] = "dist_infer",
    token_ids: bool = True,
    ttft_step_s: float = 0.0,
):
    """Streams `max_tokens` tokens per request, one a chunk, with `token_ids` in every chunk (as this
    project's server does) unless token_ids=False. Request n answers ids 1000n + j and text ' tn_j'.
    `key(body)` names a request's conversation; its turn is 1 + the requests seen with that key, and
    its first token waits ttft_step_s x turn. /metrics counts prompt units (ids, characters, or the
    characters of the messages' JSON) as queries and their longest common prefix with any earlier
    prompt as hits, under `metrics`: (the prefix), or 404 for None, or no counters for "none"."""
    app = FastAPI()
    seen = {"bodies": [], "answers": [], "spans": [], "turns": {}}
    counters = {"queries": 1000, "hits": 400}  # counted before the run: the hit rate takes differences
    prompts: list = []
    lock = threading.Lock()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-chat", "object": "model"}]}

    @app.get("/metrics")
    async def metrics_route():
        if metrics is None:
            return PlainTextResponse("not here", status_code=404)
        if metrics == "none":
            return PlainTextResponse("# a server without a prefix cache\nrequests_total 3\n")
        q, h = counters["queries"], counters["hits"]
        return PlainTextResponse(
            f'{metrics}:prefix_cache_queries_total{{engine="0"}} {q - 100}\n'
            f'{metrics}:prefix_cache_queries_total{{engine="1"}} 100\n'
            f'{metrics}:prefix_cache_hits_total{{engine="0"}} {h}\n'
        )

    async def handle(request: Request, chat: bool):
        body = await request.json()
        prompt = json.dumps(body["messages"]) if chat else body["prompt"]
        with lock:
            number = len(seen["bodies"])
            seen["bodies"].append(body)
            conversation = key(body)
            turn = seen["turns"][conversation] = seen["turns"].get(conversation, 0) + 1
            counters["queries"] += len(prompt)
            counters["hits"] += max((_common_prefix(prompt, p) for p in prompts), default=0)
            prompts.append(prompt)
        ids = [1000 * number + j for j in range(int(body["max_tokens"]))]
        seen["answers"].append({"ids": ids, "text": "".join(f" t{number}_{j}" for j in range(len(ids)))})
        started = time.monotonic()

        def chunk(j):
            text = f" t{number}_{j}"
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            if token_ids:
                choice["token_ids"] = [ids[j]]
            return "data: " + json.dumps({"choices": [choice]}) + "\n\n"

        async def events():
            await asyncio.sleep(ttft_step_s * turn)
            for j in range(len(ids)):
                yield chunk(j)
            yield (
                "data: "
                + json.dumps({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}})
                + "\n\n"
            )
            with lock:
                seen["spans"].append((conversation, turn, started, time.monotonic()))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app, seen, counters


@contextlib.contextmanager
def serving(app):
    """Run `app` with uvicorn on a free 127.0.0.1 port in a background thread; yields its URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive(), "the fake server thread died while starting"
        assert time.monotonic() < deadline, "the fake server did not start in 30 s"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = server.force_exit = True  # do not wait for handlers a test left hanging
        thread.join(15)
        sock.close()
