"""`dist-infer bench-serve`: the pure maths on hand-made inputs, then whole runs against a tiny
fake OpenAI streaming server (FastAPI + uvicorn in a thread on 127.0.0.1). No timing asserts:
the machine is shared, so only counts, contents and shapes are checked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import threading
import time

import numpy as np
import pytest
from fastapi import FastAPI, Request  # module level: the app's annotations must resolve here
from fastapi.responses import JSONResponse, StreamingResponse

from dist_infer.bench.serve.arrivals import arrival_offsets, gamma_gaps, trace_offsets
from dist_infer.bench.serve.client import RequestRecord, chunk_content, inter_token_latencies, parse_sse_line
from dist_infer.bench.serve.command import main
from dist_infer.bench.serve.datasets import approx_token_count, load_sharegpt, load_trace_csv, synthetic_lengths
from dist_infer.bench.serve.flags import InputError, parse_slo
from dist_infer.bench.serve.report import latency_stats, meets_slo, summarize

# ---------------------------------------------------------------- arrivals and lengths


def test_gamma_gaps_mean_is_one_over_rate():
    rng = np.random.default_rng(0)
    for burstiness in (0.5, 1.0, 3.0):
        gaps = gamma_gaps(200_000, rate=8.0, burstiness=burstiness, rng=rng)
        assert gaps.shape == (200_000,)
        assert (gaps >= 0).all()
        assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.02)


def test_burstiness_below_one_widens_and_above_one_narrows_the_gaps():
    rate = 4.0
    variances = {}
    for burstiness in (0.25, 1.0, 4.0):
        gaps = gamma_gaps(200_000, rate, burstiness, np.random.default_rng(1))
        variances[burstiness] = gaps.var()
        assert variances[burstiness] == pytest.approx(1 / (rate * rate * burstiness), rel=0.05)
    assert variances[0.25] > variances[1.0] > variances[4.0]


def test_arrivals_are_seeded_start_at_zero_and_infinite_rate_is_all_at_once():
    a = arrival_offsets(50, 10.0, 1.0, np.random.default_rng(7))
    b = arrival_offsets(50, 10.0, 1.0, np.random.default_rng(7))
    assert np.array_equal(a, b)
    assert a[0] == 0.0 and len(a) == 50 and (np.diff(a) >= 0).all()
    assert not np.array_equal(a, arrival_offsets(50, 10.0, 1.0, np.random.default_rng(8)))
    assert np.array_equal(arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)), np.zeros(5))
    assert len(arrival_offsets(1, 3.0, 1.0, np.random.default_rng(0))) == 1
    with pytest.raises(InputError):
        gamma_gaps(3, 1.0, 0.0, np.random.default_rng(0))


def test_trace_offsets_are_relative_to_the_first_and_scaled():
    assert trace_offsets([100.0, 101.5, 103.0], 2.0).tolist() == [0.0, 3.0, 6.0]
    assert trace_offsets([5.0, 6.0], 0.5).tolist() == [0.0, 0.5]


def test_synthetic_lengths_have_a_long_tail_clipped_to_four_times_the_mean():
    lengths = synthetic_lengths(100_000, 128, np.random.default_rng(0))
    assert lengths.dtype.kind == "i"
    assert lengths.min() >= 1 and lengths.max() <= 4 * 128
    assert lengths.max() == 4 * 128  # the tail reaches the clip
    assert lengths.mean() == pytest.approx(128, rel=0.1)
    assert np.percentile(lengths, 99) > 2.5 * np.median(lengths)  # long tail, not a narrow bump
    tiny = synthetic_lengths(1000, 1, np.random.default_rng(0))
    assert tiny.min() == 1 and tiny.max() <= 4


# ---------------------------------------------------------------- metrics


def _record(index, ttft, e2e, tokens, success=True, error="", itl=(), input_len=10):
    return RequestRecord(index=index, input_len=input_len, output_len=tokens, ttft=ttft, e2e=e2e,
                         output_tokens=tokens, success=success, error=error, itl=list(itl))


def test_latency_stats_and_tpot():
    stats = latency_stats([0.1, 0.2, 0.3, 0.4])
    assert stats["mean"] == pytest.approx(250.0)
    assert stats["median"] == pytest.approx(250.0)
    assert stats["p99"] == pytest.approx(397.0)  # linear interpolation between 300 and 400
    assert stats["p90"] == pytest.approx(370.0)
    assert stats["max"] == pytest.approx(400.0)
    assert latency_stats([]) == {"mean": None, "median": None, "p90": None, "p99": None, "max": None}
    assert _record(0, ttft=0.1, e2e=1.0, tokens=10).tpot == pytest.approx(0.1)
    assert _record(0, ttft=0.1, e2e=1.0, tokens=1).tpot is None
    assert _record(0, ttft=None, e2e=1.0, tokens=0, success=False).tpot is None


def test_inter_token_latencies_split_multi_token_chunks():
    assert inter_token_latencies([0.0, 1.0, 3.0], [1, 1, 2]) == [1.0, 1.0, 1.0]
    assert inter_token_latencies([0.5], [3]) == []
    assert inter_token_latencies([], []) == []


def test_summarize_counts_throughput_and_goodput():
    records = [
        _record(0, ttft=0.1, e2e=1.0, tokens=10, itl=[0.1] * 9),   # tpot 0.1
        _record(1, ttft=0.2, e2e=0.6, tokens=5, itl=[0.1] * 4),    # tpot 0.1
        _record(2, ttft=0.9, e2e=1.9, tokens=11, itl=[0.1] * 10),  # tpot 0.1, ttft too slow for 0.5
        _record(3, ttft=None, e2e=0.01, tokens=0, success=False, error="HTTP 400: bad"),
    ]
    summary = summarize(records, duration_s=2.0, slo={"ttft": 0.5})
    assert summary["completed"] == 3 and summary["failed"] == 1
    assert summary["total_output_tokens"] == 26
    assert summary["total_input_tokens"] == 30
    assert summary["request_throughput"] == pytest.approx(1.5)
    assert summary["output_throughput"] == pytest.approx(13.0)
    assert summary["total_token_throughput"] == pytest.approx(28.0)
    assert summary["goodput"] == pytest.approx(1.0)  # 2 of the 3 meet ttft <= 0.5 s, over 2 s
    assert summary["errors"] == {"HTTP 400: bad": 1}
    many = summarize([_record(i, None, 0.1, 0, success=False, error=f"e{i % 12}") for i in range(24)], 1.0)
    assert len(many["errors"]) == 11 and many["errors"]["(2 other error texts)"] == 4
    assert summary["ttft_ms"]["median"] == pytest.approx(200.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert summary["itl_ms"]["mean"] == pytest.approx(100.0)
    assert summary["e2e_ms"]["mean"] == pytest.approx(3500.0 / 3)
    assert summarize(records, 2.0, slo={"ttft": 1.0, "e2e": 0.8})["goodput"] == pytest.approx(0.5)
    assert summarize(records, 2.0)["goodput"] is None
    assert summarize(records, 2.0, slo={"tpot": 0.05})["goodput"] == 0.0


def test_meets_slo_edge_cases():
    one_token = _record(0, ttft=0.1, e2e=0.1, tokens=1)
    assert meets_slo(one_token, {"tpot": 0.001})  # no gaps, nothing to break
    no_content = _record(1, ttft=None, e2e=0.3, tokens=0)
    assert meets_slo(no_content, {"ttft": 0.5}) and not meets_slo(no_content, {"ttft": 0.2})
    assert not meets_slo(_record(2, ttft=0.1, e2e=0.2, tokens=3, success=False), {"ttft": 1.0})


# ---------------------------------------------------------------- SLO and SSE parsing


def test_parse_slo():
    assert parse_slo("ttft=0.5,tpot=0.05") == {"ttft": 0.5, "tpot": 0.05}
    assert parse_slo(" E2E = 10 ") == {"e2e": 10.0}


@pytest.mark.parametrize("text, named", [
    ("ttft=abc", "ttft=abc"),
    ("ttft=0.5,foo=1", "foo=1"),
    ("tpot", "tpot"),
    ("e2e=-1", "e2e=-1"),
    ("ttft=1,ttft=2", "ttft=2"),
    ("ttft=nan", "ttft=nan"),
])
def test_parse_slo_errors_name_the_bad_item(text, named):
    with pytest.raises(InputError, match=f"'{named}'"):
        parse_slo(text)
    with pytest.raises(InputError):
        parse_slo(",")


def test_bad_slo_flag_exits_2_naming_the_item(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--slo", "ttft=0.5,itl=3"])
    assert exc.value.code == 2
    assert "itl=3" in capsys.readouterr().err


def test_parse_sse_line():
    assert parse_sse_line('data: {"a": 1}') == ("data", {"a": 1})
    assert parse_sse_line('data:{"a": 2}\r\n') == ("data", {"a": 2})
    assert parse_sse_line("data: [DONE]").kind == "done"
    for skipped in ("", ": ping", "event: message", "id: 3", "data:"):
        assert parse_sse_line(skipped).kind == "skip"
    with pytest.raises(ValueError, match="undecodable"):
        parse_sse_line("data: {not json")
    with pytest.raises(ValueError, match="not a JSON object"):
        parse_sse_line("data: [1, 2]")


def test_chunk_content_of_completions_chat_token_ids_usage_and_errors():
    text = chunk_content({"choices": [{"index": 0, "text": " hi", "finish_reason": None}]})
    assert (text.text, text.tokens, text.completion_tokens) == (" hi", 1, None)
    chat = chunk_content({"choices": [{"index": 0, "delta": {"content": "yo"}}]})
    assert (chat.text, chat.tokens) == ("yo", 1)
    role_only = chunk_content({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    assert role_only.tokens == 0 and role_only.text == ""
    ids = chunk_content({"choices": [{"index": 0, "text": " a b c", "token_ids": [4, 5, 6]}]})
    assert ids.tokens == 3
    usage = chunk_content({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 12}})
    assert (usage.tokens, usage.completion_tokens, usage.prompt_tokens) == (0, 12, 7)
    continuous = chunk_content({"choices": [{"text": "xy"}], "usage": {"completion_tokens": 5}}, 3)
    assert continuous.tokens == 2
    whole = chunk_content({"choices": [{"message": {"role": "assistant", "content": "all of it"}}],
                           "usage": {"completion_tokens": 3}})
    assert (whole.text, whole.completion_tokens) == ("all of it", 3)
    error = chunk_content({"error": {"message": "out of memory", "code": 500}})
    assert error.error == "error in stream: out of memory"


# ---------------------------------------------------------------- datasets


def test_sharegpt_prompt_is_first_human_turn_and_output_is_first_gpt_reply(tmp_path):
    path = tmp_path / "share.json"
    path.write_text(json.dumps([
        {"id": "a", "conversations": [
            {"from": "human", "value": "tell me a story about cats"},
            {"from": "gpt", "value": "once upon a time there were ten cats"},
            {"from": "human", "value": "more"}, {"from": "gpt", "value": "no"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "only a question"}]},
        {"id": "c", "conversations": [
            {"from": "gpt", "value": "greeting first"},
            {"from": "human", "value": "why"}, {"from": "gpt", "value": "because"}]},
        {"id": "d"},
    ]))
    entries = load_sharegpt(path)
    assert [e.prompt for e in entries] == ["tell me a story about cats", "why"]
    assert entries[0].output_len == round(8 * 1.3) == approx_token_count("once upon a time there were ten cats")
    assert entries[0].input_len == round(6 * 1.3)
    assert entries[1].output_len == 1 and entries[1].timestamp is None
    exact = load_sharegpt(path, count_tokens=lambda text: len(text))
    assert exact[0].input_len == len("tell me a story about cats")


def test_sharegpt_errors_name_the_file(tmp_path):
    with pytest.raises(InputError, match="missing.json does not exist"):
        load_sharegpt(tmp_path / "missing.json")
    bad = tmp_path / "dict.json"
    bad.write_text('{"conversations": []}')
    with pytest.raises(InputError, match="dict.json"):
        load_sharegpt(bad)
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(InputError, match="empty.json: no conversation"):
        load_sharegpt(empty)
    broken = tmp_path / "broken.json"
    broken.write_text("[{")
    with pytest.raises(InputError, match="broken.json is not valid JSON"):
        load_sharegpt(broken)


def test_azure_trace_csv(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,396,109\n"
                    "2023-11-16 18:15:47.1805900,879,0\n")
    entries = load_trace_csv(path)
    assert [(e.input_len, e.output_len) for e in entries] == [(374, 44), (879, 1), (396, 109)]  # sorted by time
    offsets = trace_offsets([e.timestamp for e in entries])
    assert offsets.tolist() == pytest.approx([0.0, 0.5, 4.314579])


def test_burstgpt_trace_csv(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "5,ChatGPT,472,18,490,Conversation log\n"
                    "45,ChatGPT,1087,0,1087,Conversation log\n"
                    "118,GPT-4,417,276,693,API log\n")
    entries = load_trace_csv(path)
    assert [(e.timestamp, e.input_len, e.output_len) for e in entries] == [
        (5.0, 472, 18), (45.0, 1087, 1), (118.0, 417, 276)]
    assert trace_offsets([e.timestamp for e in entries], 0.1).tolist() == pytest.approx([0.0, 4.0, 11.3])


def test_trace_csv_errors_name_the_file_column_and_line(tmp_path):
    no_output = tmp_path / "no_output.csv"
    no_output.write_text("Timestamp,Request tokens\n1,2\n")
    with pytest.raises(InputError, match=r"no_output.csv: no generated tokens column.*Request tokens"):
        load_trace_csv(no_output)
    bad_value = tmp_path / "bad_value.csv"
    bad_value.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n2,lots,3\n")
    with pytest.raises(InputError, match=r"bad_value.csv:3: bad 'ContextTokens' value 'lots'"):
        load_trace_csv(bad_value)
    with pytest.raises(InputError, match="nope.csv does not exist"):
        load_trace_csv(tmp_path / "nope.csv")
    header_only = tmp_path / "header_only.csv"
    header_only.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(InputError, match="header_only.csv: the trace has a header but no rows"):
        load_trace_csv(header_only)


def test_bad_dataset_exits_2_with_a_message_naming_it(tmp_path, capsys):
    missing = tmp_path / "nowhere.json"
    assert main(["--dataset", str(missing), "--url", "http://127.0.0.1:9"]) == 2
    assert f"{missing} does not exist" in capsys.readouterr().err
    malformed = tmp_path / "malformed.csv"
    malformed.write_text("when,ContextTokens,GeneratedTokens\n1,2,3\n")
    assert main(["--dataset", str(malformed), "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "malformed.csv: no timestamp column" in err and "when" in err


def test_output_in_a_missing_directory_exits_2_before_the_run(tmp_path, capsys):
    assert main(["--url", "http://127.0.0.1:9", "--plot", str(tmp_path / "no" / "cdf.png")]) == 2
    assert f"--plot {tmp_path / 'no' / 'cdf.png'}: directory {tmp_path / 'no'} does not exist" in capsys.readouterr().err


def test_unreachable_server_without_model_exits_2(capsys):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["--url", f"http://127.0.0.1:{port}", "--num-prompts", "2"]) == 2
    assert "/v1/models" in capsys.readouterr().err


# ---------------------------------------------------------------- a fake OpenAI streaming server


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
                return JSONResponse({"error": {"message": f"fake rejection of request {number}",
                                               "type": "BadRequestError", "code": 400}}, status_code=400)
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
            return {"id": "x", "object": "text_completion", "model": body["model"],
                    "choices": [{"index": 0, "text": " w" * max_tokens, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                              "total_tokens": prompt_tokens + max_tokens}}

        def chunk(text, ids=None, finish=None):
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            if ids is not None:
                choice["token_ids"] = ids
            return "data: " + json.dumps({"id": "x", "object": "chunk", "model": body["model"],
                                          "choices": [choice], "usage": None}) + "\n\n"

        async def events():
            yield ": keep-alive\n\n"
            if chat:
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}) + "\n\n"
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
                yield "data: " + json.dumps({"choices": [], "usage": {
                    "prompt_tokens": prompt_tokens, "completion_tokens": sent,
                    "total_tokens": prompt_tokens + sent}}) + "\n\n"
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


def _last_json(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    return json.loads(lines[-1])


def test_end_to_end_completions_json_plot_and_results(tmp_path, capsys):
    app, seen = make_fake_server()
    plot, results = tmp_path / "cdf.png", tmp_path / "records.json"
    with serving(app) as url:
        code = main(["--url", url, "--num-prompts", "20", "--request-rate", "200", "--burstiness", "0.5",
                     "--input-len", "16", "--output-len", "12", "--ignore-eos", "--slo", "ttft=60,e2e=120",
                     "--json", "--plot", str(plot), "--save-results", str(results), "--seed", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = _last_json(out)
    assert summary["completed"] == 20 and summary["failed"] == 0
    assert summary["model"] == "fake-model"
    assert summary["total_output_tokens"] == sum(seen["sent"])
    assert summary["goodput"] is not None and summary["goodput"] > 0
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert summary[metric]["p99"] is not None
    assert "Request throughput" in out and "TTFT" in out

    bodies = seen["bodies"]
    assert len(bodies) == 20
    assert all(b["model"] == "fake-model" and b["stream"] is True and b["ignore_eos"] is True
               and b["stream_options"] == {"include_usage": True} and b["temperature"] == 0
               and isinstance(b["prompt"], str) for b in bodies)

    records = json.loads(results.read_text())["requests"]
    assert len(records) == 20
    assert sorted(r["output_tokens"] for r in records) == sorted(seen["sent"])
    for r in records:
        assert r["success"] and r["error"] == ""
        assert r["output_tokens"] == r["output_len"]  # the fake server sends exactly max_tokens
        assert sum(r["chunk_tokens"]) == r["output_tokens"]
        assert len(r["itl"]) == r["output_tokens"] - 1
        assert r["ttft"] is not None and r["e2e"] >= r["ttft"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_end_to_end_chat_with_failures_and_no_usage(tmp_path, capsys):
    app, seen = make_fake_server(fail_every=4, usage=False)
    results, share = tmp_path / "records.json", tmp_path / "share.json"
    answers = {f"question number {i} " + "why " * i: "answer " * (1 + i % 9) for i in range(25)}
    share.write_text(json.dumps([{"conversations": [{"from": "human", "value": question},
                                                    {"from": "gpt", "value": answer}]}
                                 for question, answer in answers.items()]))
    with serving(app) as url:
        code = main(["--url", url + "/v1/", "--model", "chat-model", "--endpoint", "chat", "--num-prompts", "20",
                     "--request-rate", "300", "--dataset", str(share), "--max-input-len", "30", "--json",
                     "--save-results", str(results)])
    out = capsys.readouterr().out
    assert code == 1  # the run finishes, and says some requests failed
    summary = _last_json(out)
    assert seen["rejected"] == 5
    assert summary["completed"] == 15 and summary["failed"] == 5
    assert all(b["model"] == "chat-model" and b["messages"][0]["role"] == "user" for b in seen["bodies"])
    asked = [b["messages"][0]["content"] for b in seen["bodies"]]
    assert len(set(asked)) == 20 and set(asked) <= set(answers)
    assert all(approx_token_count(q) <= 30 for q in asked)  # --max-input-len skips longer ShareGPT prompts
    for body in seen["bodies"]:  # max_tokens: the first gpt reply's length, words x 1.3
        assert body["max_tokens"] == approx_token_count(answers[body["messages"][0]["content"]])
    assert sum(summary["errors"].values()) == 5
    assert all(error.startswith("HTTP 400: ") and "fake rejection of request" in error for error in summary["errors"])
    assert "failed x1: HTTP 400: " in out

    records = json.loads(results.read_text())["requests"]
    failed = [r for r in records if not r["success"]]
    assert len(failed) == 5 and all("fake rejection" in r["error"] for r in failed)
    done = [r for r in records if r["success"]]
    # no usage: tokens are counted from chunks, 2-token chunks by their token_ids
    assert sorted(r["output_tokens"] for r in done) == sorted(seen["sent"])
    assert all(r["output_tokens"] == r["output_len"] for r in done)
    assert summary["total_output_tokens"] == sum(seen["sent"])


def test_end_to_end_trace_with_prompt_ids_and_max_concurrency(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    rows = [f"{10 + 0.1 * i:.1f},{5 + i},{3 + i % 4}" for i in range(20)]
    trace.write_text("Timestamp,Request tokens,Response tokens\n" + "\n".join(rows) + "\n")
    app, seen = make_fake_server()
    with serving(app) as url:
        code = main(["--url", url, "--dataset", str(trace), "--time-scale", "0.05", "--num-prompts", "50",
                     "--prompt-ids", "--vocab-size", "50", "--max-input-len", "20", "--max-concurrency", "3",
                     "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = _last_json(out)
    assert summary["completed"] == 20 and summary["num_prompts"] == 20
    assert summary["arrivals"].startswith("trace timestamps")
    assert seen["max_in_flight"] <= 3
    prompts = [b["prompt"] for b in seen["bodies"]]
    assert all(isinstance(p, list) and all(10 <= t < 50 for t in p) for p in prompts)
    assert sorted(len(p) for p in prompts) == sorted(min(5 + i, 20) for i in range(20))
    assert sorted(b["max_tokens"] for b in seen["bodies"]) == sorted(3 + i % 4 for i in range(20))
    assert summary["total_input_tokens"] == sum(min(5 + i, 20) for i in range(20))  # from usage
    assert summary["total_output_tokens"] == sum(seen["sent"])


def test_end_to_end_timeout_and_a_server_that_ignores_stream(capsys):
    app, seen = make_fake_server(stall_every=3, stream=False)
    with serving(app) as url:
        code = main(["--url", url, "--num-prompts", "6", "--output-len", "5", "--timeout", "2", "--json"])
    out = capsys.readouterr().out
    assert code == 1
    summary = _last_json(out)
    assert summary["completed"] == 4 and summary["failed"] == 2
    assert summary["errors"] == {"timed out after 2 s": 2}
    assert summary["total_output_tokens"] == sum(seen["sent"])


def test_tokenizer_file_counts_and_encodes(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dist_infer.bench.serve.datasets import load_tokenizer_counter

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    count, encode = load_tokenizer_counter(tmp_path)  # a directory holding tokenizer.json
    assert encode("hello world hello") == [1, 2, 1]
    assert count("hello there") == 2
    with pytest.raises(InputError, match="tokenizer file .*nothing does not exist"):
        load_tokenizer_counter(tmp_path / "nothing")
