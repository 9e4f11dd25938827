"""The OpenAI-compatible HTTP API over real HTTP on 127.0.0.1, in front of a fake engine.

The fake (tests/support/fake_engine.py) implements the engine interface the server codes against
with deterministic tokens, so the tests can check exact tokens, that a client that leaves aborts
its request, and that every block comes back. The app runs on uvicorn in a background thread of
this process; the official `openai` client and raw httpx talk to it. (SIGTERM to a server
process: tests/integration/test_api_server_sigterm.py.)
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass

import httpx
import openai
import pytest

from dist_infer.serving.http.api_server import DrainingServer, build_app
from tests.support.fake_engine import MAX_MODEL_LEN, MODEL, FakeEngine, FakeTokenizer, fake_tokens
from tests.support.polling import wait_until


@dataclass
class Served:
    engine: FakeEngine
    url: str
    server: DrainingServer

    @property
    def v1(self) -> str:
        return self.url + "/v1"


def start_in_thread(engine: FakeEngine, grace_s: float = 5.0) -> tuple[Served, threading.Thread]:
    app = build_app(engine, MODEL)
    ready = threading.Event()
    port = {}
    server = DrainingServer(
        app, "127.0.0.1", 0, grace_s=grace_s, on_ready=lambda host, p: (port.update(p=p), ready.set())
    )
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    assert ready.wait(30), "the server did not start"
    return Served(engine, f"http://127.0.0.1:{port['p']}", server), thread


@pytest.fixture(scope="module")
def served():
    served, thread = start_in_thread(FakeEngine())
    yield served
    served.server.request_shutdown()
    thread.join(30)


@pytest.fixture(autouse=True)
def fresh_engine(request):
    if "served" in request.fixturenames:
        request.getfixturevalue("served").engine.reset()
    yield


def http() -> httpx.Client:
    return httpx.Client(trust_env=False, timeout=30)  # loopback only, whatever the environment says


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.v1, api_key="x", max_retries=0, http_client=http())


def sse_events(response: httpx.Response) -> list:
    """Parse a whole SSE body strictly: `data: ...` then a blank line, every event."""
    text = response.read().decode()
    assert text.endswith("\n\n"), text[-200:]
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events and events[-1] == "[DONE]", events[-3:]
    assert "[DONE]" not in events[:-1]
    return events[:-1]


# -- the official client ------------------------------------------------------------------------------


def test_openai_client_completions(served):
    c = client(served)
    assert [m.id for m in c.models.list().data] == [MODEL]
    prompt_ids = FakeTokenizer().encode("Hello there")
    want = fake_tokens(prompt_ids, 7)
    r = c.completions.create(model=MODEL, prompt="Hello there", max_tokens=7, temperature=0)
    choice = r.choices[0]
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert choice.token_ids == want and choice.text == "".join(map(chr, want))
    assert choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(prompt_ids),
        7,
        len(prompt_ids) + 7,
    )
    assert r.model_extra["prompt_token_ids"] == prompt_ids

    by_ids = c.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=7)
    assert by_ids.choices[0].token_ids == want
    default_len = c.completions.create(prompt=[prompt_ids], model=MODEL)  # a list of one prompt; default 16 tokens
    assert default_len.usage.completion_tokens == 16

    text, ids, usage, chunks = "", [], None, 0
    for chunk in c.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=7, stream=True, stream_options={"include_usage": True}
    ):
        chunks += 1
        if chunk.choices:
            text += chunk.choices[0].text
            ids += chunk.choices[0].token_ids
        if chunk.usage:
            usage = chunk.usage
    assert ids == want and text == choice.text and chunks == 8
    assert usage.completion_tokens == 7 and usage.prompt_tokens == len(prompt_ids)


def test_openai_client_chat(served):
    c = client(served)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    rendered = "<s><|system|>Be brief.\n<|user|>Say hi\n<|assistant|>"
    prompt_ids = FakeTokenizer().encode(rendered)
    want = fake_tokens(prompt_ids, 5)
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.7, seed=3)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == "".join(map(chr, want))
    assert r.choices[0].token_ids == want and r.model_extra["prompt_token_ids"] == prompt_ids
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens == len(prompt_ids)

    new_name = c.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3)
    assert new_name.usage.completion_tokens == 3
    defaulted = c.chat.completions.create(model=MODEL, messages=messages)  # fills the positions
    assert defaulted.usage.total_tokens == MAX_MODEL_LEN and defaulted.choices[0].finish_reason == "length"

    pieces = list(
        c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    )
    assert pieces[0].choices[0].delta.role == "assistant" and pieces[0].choices[0].delta.content == ""
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == msg.content
    assert [t for p in pieces if p.choices for t in p.choices[0].token_ids] == want
    assert pieces[-1].choices == [] and pieces[-1].usage.completion_tokens == 5
    assert [p.choices[0].finish_reason for p in pieces if p.choices][-1] == "length"


# -- raw HTTP: wire format ---------------------------------------------------------------------------


def test_completion_stream_wire_format(served):
    prompt = [1, 40, 41, 42]
    want = fake_tokens(prompt, 4)
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http() as h, h.stream("POST", served.v1 + "/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    chunks, usage = events[:-1], events[-1]
    assert len(chunks) == 4 and all(len(c["choices"]) == 1 for c in chunks)
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[t] for t in want], "every chunk carries its new ids"
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}


def test_chat_stream_wire_format_and_logprobs(served):
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hey"}]}],
        "max_tokens": 3,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    with http() as h, h.stream("POST", served.v1 + "/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["object"] == "chat.completion.chunk" and isinstance(events[0]["prompt_token_ids"], list)
    content = events[1:]
    assert len(content) == 3 and all("usage" not in e for e in events), "no usage unless asked for"
    for e in content:
        (entry,) = e["choices"][0]["logprobs"]["content"]
        assert entry["token"] == chr(e["choices"][0]["token_ids"][0]) and len(entry["top_logprobs"]) == 2
        assert entry["bytes"] == list(entry["token"].encode())


def test_completion_logprobs_shape(served):
    with http() as h:
        r = h.post(served.v1 + "/completions", json={"prompt": [1, 50, 60], "max_tokens": 3, "logprobs": 2}).json()
        zero = h.post(served.v1 + "/completions", json={"prompt": [1, 50, 60], "max_tokens": 3, "logprobs": 0}).json()
    lp = r["choices"][0]["logprobs"]
    ids = r["choices"][0]["token_ids"]
    assert lp["tokens"] == [chr(t) for t in ids] and lp["text_offset"] == [0, 1, 2]
    assert len(lp["token_logprobs"]) == 3 and all(isinstance(x, float) for x in lp["token_logprobs"])
    assert all(len(d) == 2 for d in lp["top_logprobs"]) and all(
        lp["tokens"][i] in d for i, d in enumerate(lp["top_logprobs"])
    )
    assert [list(d) for d in zero["choices"][0]["logprobs"]["top_logprobs"]] == [[chr(t)] for t in ids]


def test_stop_token_ids_and_ignored_fields(served):
    prompt = [1, 20, 30]
    want = fake_tokens(prompt, 6)
    body = {
        "prompt": prompt,
        "max_tokens": 6,
        "stop_token_ids": [want[2]],
        "ignore_eos": True,
        "top_k": -1,
        "min_tokens": 0,
        "return_token_ids": True,
        "some_future_field": {"x": 1},
        "user": "u",
    }
    with http() as h:
        r = h.post(served.v1 + "/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want[:3] and choice["finish_reason"] == "stop" and choice["stop_reason"] == want[2]


def test_tokenize_and_detokenize(served):
    with http() as h:
        t = h.post(served.url + "/tokenize", json={"prompt": "abc"}).json()
        assert t["tokens"] == [1, 97, 98, 99] and t["count"] == 4 and t["max_model_len"] == MAX_MODEL_LEN
        assert h.post(served.url + "/detokenize", json={"tokens": [97, 98]}).json() == {"prompt": "ab"}
        bad = h.post(served.url + "/detokenize", json={"tokens": [5000]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# -- errors --------------------------------------------------------------------------------------------

BAD = [
    # (endpoint, body: dict or raw text, param, text the message must contain)
    ("completions", "not json", None, "JSON"),
    ("completions", "[1, 2]", None, "object"),
    ("completions", "", None, "empty"),
    ("completions", {"prompt": "hi", "model": "nope"}, "model", "nope"),
    ("completions", {"prompt": [1, 10**7]}, "prompt", "vocabulary"),
    ("completions", {"prompt": [1, 2], "max_tokens": 5000}, "max_tokens", str(MAX_MODEL_LEN)),
    ("completions", {"prompt": [1, 2], "max_tokens": -1}, "max_tokens", ">= 1"),
    ("completions", {"prompt": [1, 2], "max_tokens": "lots"}, "max_tokens", None),
    ("completions", {"prompt": [1, 2], "temperature": -2}, "temperature", None),
    ("completions", {"prompt": [1, 2], "temperature": 1e9}, "temperature", None),
    ("completions", {"prompt": [1, 2], "top_p": 7}, "top_p", None),
    ("completions", {"prompt": [1, 2], "top_k": -5}, "top_k", None),
    ("completions", {"prompt": [1, 2], "seed": -1}, "seed", None),
    ("completions", {"prompt": [1, 2], "logprobs": 50}, "logprobs", "20"),
    ("completions", {"prompt": [1, 2], "n": 2}, "n", None),
    ("completions", {"prompt": [1, 2], "echo": True}, "echo", None),
    ("completions", {"prompt": [1, 2], "max_tokens": 4, "min_tokens": 9}, "min_tokens", None),
    ("completions", {"prompt": [1, 2], "presence_penalty": 0.5}, "presence_penalty", None),
    ("completions", {"prompt": [1, 2], "stream_options": "yes"}, "stream_options", None),
    ("completions", {"prompt": ""}, "prompt", "empty"),
    ("completions", {"prompt": []}, "prompt", "empty"),
    ("completions", {"prompt": ["a", "b"]}, "prompt", "batch"),
    ("completions", {"prompt": [[1, 2], [3]]}, "prompt", "batch"),
    ("completions", {"prompt": [1, "x"]}, "prompt", None),
    ("completions", {"max_tokens": 3}, "prompt", "required"),
    ("chat/completions", {"messages": []}, "messages", None),
    ("chat/completions", {"prompt": "hi"}, "messages", None),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
    ("chat/completions", {"messages": [{"role": "assistant", "content": "x"}]}, "messages", "user turn"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "text"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs", None),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30},
        "top_logprobs",
        "20",
    ),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000}, "max_tokens", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, "model", "gpt-4"),
]


@pytest.mark.parametrize("endpoint,body,param,needle", BAD, ids=[f"{e}:{p}:{i}" for i, (e, _, p, _) in enumerate(BAD)])
def test_bad_request_is_400_naming_the_field(served, endpoint, body, param, needle):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    with http() as h:
        r = h.post(f"{served.v1}/{endpoint}", headers={"content-type": "application/json"}, **kw)
    assert r.status_code == 400, (body, r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"], err
    assert err["param"] == param, (body, err)
    if needle:
        assert needle in err["message"], (body, err)


def test_bad_requests_leave_the_server_serving(served):
    """Bad and good requests at once: the good ones complete, exactly."""

    async def go():
        async with httpx.AsyncClient(trust_env=False, timeout=30) as h:
            good = [h.post(served.v1 + "/completions", json={"prompt": [1, i], "max_tokens": 5}) for i in range(4)]
            bad = [
                h.post(served.v1 + "/completions", content=b"{", headers={"content-type": "application/json"}),
                h.post(served.v1 + "/completions", json={"prompt": [1, 2], "top_p": 0}),
            ]
            return await asyncio.gather(*good), await asyncio.gather(*bad)

    good, bad = asyncio.run(go())
    assert [r.status_code for r in bad] == [400, 400]
    assert [r.json()["choices"][0]["token_ids"] for r in good] == [fake_tokens([1, i], 5) for i in range(4)]


def test_unknown_route_is_404_in_openai_shape(served):
    with http() as h:
        r = h.get(served.v1 + "/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_queue_full_is_503_with_retry_after(served):
    served.engine.queue_full = True
    with http() as h:
        for stream in (False, True):
            r = h.post(served.v1 + "/completions", json={"prompt": [1, 2], "max_tokens": 2, "stream": stream})
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "3"
            assert r.json()["error"]["type"] == "ServiceUnavailableError"
        served.engine.queue_full = False
        assert h.post(served.v1 + "/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200


def test_engine_death_is_500_or_an_error_event(served):
    engine = served.engine
    engine.die_after = 2
    with http() as h:
        with h.stream(
            "POST", served.v1 + "/completions", json={"prompt": [1, 2], "max_tokens": 9, "stream": True}
        ) as r:
            assert r.status_code == 200
            events = sse_events(r)
        assert [len(e["choices"][0]["token_ids"]) for e in events[:-1]] == [1, 1]
        assert events[-1]["error"]["code"] == 500 and "rank 1 died" in events[-1]["error"]["message"]
        r = h.post(served.v1 + "/completions", json={"prompt": [1, 2], "max_tokens": 9})
        assert r.status_code == 500 and "rank 1 died" in r.json()["error"]["message"]

        engine.die_after = None
        engine.dead_reason = "rank 3 exited with SIGKILL"
        health = h.get(served.url + "/health")
        assert health.status_code == 503 and "SIGKILL" in health.json()["error"]["message"]
        r = h.post(
            served.v1 + "/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        )
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
        engine.dead_reason = None
        assert h.get(served.url + "/health").status_code == 200
    wait_until(lambda: engine.free_blocks == engine.total_blocks, 15.0, "every block free again")


# -- metrics ------------------------------------------------------------------------------------------


def scrape(served: Served) -> dict[str, float]:
    """name{labels} -> value."""
    with http() as h:
        text = h.get(served.url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_metrics_names_and_token_counts(served):
    label = f'model_name="{MODEL}"'
    before = scrape(served)
    with http() as h:
        h.post(served.v1 + "/completions", json={"prompt": [1, 2, 3], "max_tokens": 5}).raise_for_status()
        with h.stream(
            "POST", served.v1 + "/completions", json={"prompt": [1, 2], "max_tokens": 4, "stream": True}
        ) as r:
            sse_events(r)
    after = scrape(served)

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta(f"dist_infer:generation_tokens_total{{{label}}}") == 9
    assert delta(f"dist_infer:prompt_tokens_total{{{label}}}") == 5
    assert delta(f'dist_infer:request_success_total{{finished_reason="length",{label}}}') == 2
    assert delta(f"dist_infer:time_to_first_token_seconds_count{{{label}}}") == 2
    assert delta(f"dist_infer:e2e_request_latency_seconds_count{{{label}}}") == 2
    assert delta(f"dist_infer:inter_token_latency_seconds_count{{{label}}}") == 7
    assert delta(f"dist_infer:request_generation_tokens_sum{{{label}}}") == 9
    assert delta(f"dist_infer:request_prompt_tokens_sum{{{label}}}") == 5
    engine = f'engine="0",{label}'  # vLLM's label for the instance the engine state is of
    assert after[f"dist_infer:num_preemptions_total{{{engine}}}"] == 7
    assert after[f"dist_infer:kv_cache_usage_perc{{{engine}}}"] == 0.0
    assert after[f"dist_infer:num_requests_running{{{engine}}}"] == 0.0
    assert f"dist_infer:num_requests_waiting{{{engine}}}" in after


def test_two_apps_in_one_process_have_their_own_registries():
    a, b = build_app(FakeEngine(), "a"), build_app(FakeEngine(), "b")
    assert a.state.serving.metrics.registry is not b.state.serving.metrics.registry


# -- clients that leave ----------------------------------------------------------------------------------


def test_client_leaving_a_stream_aborts_its_request(served):
    engine = served.engine
    engine.token_delay = 0.05
    body = {"prompt": [1, 5, 6], "max_tokens": 100, "stream": True}
    with http() as h, h.stream("POST", served.v1 + "/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first[len("data: ") :])["id"]
    # the connection is closed with the request still generating
    wait_until(lambda: request_id in engine.aborted, 15.0, f"abort({request_id})")
    wait_until(lambda: engine.free_blocks == engine.total_blocks, 15.0, "every block free again")


def test_client_leaving_a_pending_answer_aborts_its_request(served):
    engine = served.engine
    engine.token_delay = 0.05
    n_started = len(engine.started)
    with httpx.Client(trust_env=False, timeout=httpx.Timeout(30, read=0.5)) as h:
        with pytest.raises(httpx.ReadTimeout):
            h.post(served.v1 + "/completions", json={"prompt": [1, 7], "max_tokens": 100})
    wait_until(lambda: len(engine.started) > n_started, 15.0, "the request started")
    request_id = engine.started[n_started]
    wait_until(lambda: request_id in engine.aborted, 15.0, f"abort({request_id})")
    wait_until(lambda: engine.free_blocks == engine.total_blocks, 15.0, "every block free again")


# -- shutdown -------------------------------------------------------------------------------------------


def test_shutdown_lets_running_streams_finish():
    engine = FakeEngine()
    engine.token_delay = 0.02
    served, thread = start_in_thread(engine, grace_s=20)
    body = {"prompt": [1, 9], "max_tokens": 30, "stream": True}
    with http() as h, h.stream("POST", served.v1 + "/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        served.server.request_shutdown()
        wait_until(lambda: not engine.accepting, 15.0, "the engine told to stop accepting")
        try:  # a new request: refused at the socket once uvicorn stops listening, 503 before that
            with http() as other:
                late = other.post(served.v1 + "/completions", json={"prompt": [1, 2], "max_tokens": 2})
            assert late.status_code == 503 and "retry-after" in late.headers, late.text
        except (httpx.ConnectError, httpx.ReadError):
            pass  # refused, or reset: connected into the backlog just as the listening socket closed
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert rest[-1]["choices"][0]["finish_reason"] == "length" and len(rest) == 29
    thread.join(30)
    assert not thread.is_alive()
    assert engine.aborted == []


def test_shutdown_aborts_what_outlives_the_grace_period():
    engine = FakeEngine()
    engine.token_delay = 0.05
    served, thread = start_in_thread(engine, grace_s=0.3)
    body = {"prompt": [1, 9], "max_tokens": 120, "stream": True}
    with http() as h, h.stream("POST", served.v1 + "/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        served.server.request_shutdown()
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    thread.join(30)
    assert not thread.is_alive() and len(engine.aborted) == 1
