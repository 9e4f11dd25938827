"""bench-serve's workloads with prefixes: the shared-prefix dataset, multi-turn replay (against a
tiny fake OpenAI server in a thread that streams token ids like this project's server and counts
prefix cache hits on its /metrics), per-turn TTFT and the hit-rate scrape. Timing is only checked
as lower bounds the fake server itself imposes (the machine is shared)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import threading
import time
from typing import Callable, Optional

import numpy as np
import pytest
from fastapi import FastAPI, Request  # module level: the app's annotations must resolve here
from fastapi.responses import PlainTextResponse, StreamingResponse

from dist_infer.bench.serve.cache_metrics import CacheCounters, cache_report_line, cache_summary, parse_cache_counters
from dist_infer.bench.serve.client import RequestRecord
from dist_infer.bench.serve.command import main
from dist_infer.bench.serve.conversations import build_conversations, sharegpt_turns
from dist_infer.bench.serve.datasets import build_requests, sentence_text_prompt
from dist_infer.bench.serve.flags import InputError, add_bench_serve_flags
from dist_infer.bench.serve.multiturn import TEXT_SEPARATOR, ttft_by_turn, turn_report_lines


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_serve_flags(parser)
    return parser.parse_args(list(argv))


def _last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.strip()][-1])


# ---------------------------------------------------------------- the shared-prefix dataset


def test_prefix_dataset_requests_share_exactly_the_prefix_in_k_groups():
    args = _args("--dataset", "prefix", "--prompt-ids", "--num-prompts", "14", "--num-prefixes", "4",
                 "--prefix-len", "16", "--suffix-len", "6", "--output-len", "9", "--request-rate", "5")
    requests, arrivals = build_requests(args, np.random.default_rng(0))
    assert len(requests) == 14 and arrivals == "Poisson at 5 req/s"
    assert all(len(r.prompt) == 22 and r.input_len == 22 and r.output_len == 9 for r in requests)
    groups = {}
    for r in requests:  # round robin: request i has prefix i mod 4
        groups.setdefault(r.index % 4, []).append(r.prompt)
    assert [len(g) for g in groups.values()] == [4, 4, 3, 3]
    prefixes = {tuple(g[0][:16]) for g in groups.values()}
    assert len(prefixes) == 4  # distinct prefixes
    for group in groups.values():
        assert all(p[:16] == group[0][:16] for p in group)
        assert len({tuple(p[16:]) for p in group}) == len(group)  # every suffix its own
    assert all(10 <= t < 1000 for r in requests for t in r.prompt)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)


def test_prefix_dataset_is_reproducible_by_seed():
    for extra in ((), ("--prompt-ids",)):
        args = _args("--dataset", "prefix", "--num-prompts", "6", "--num-prefixes", "2", "--prefix-len", "12",
                     "--suffix-len", "3", *extra)
        a, _ = build_requests(args, np.random.default_rng(5))
        b, _ = build_requests(args, np.random.default_rng(5))
        c, _ = build_requests(args, np.random.default_rng(6))
        assert a == b and a != c


def test_text_prefix_tokenizes_the_same_before_any_suffix():
    """The tiny model's byte-level BPE sees the same leading ids in every request of a group."""
    from tokenizers import Tokenizer

    from dist_infer.models.tiny_model import ensure_tiny_model

    tokenizer = Tokenizer.from_file(str(ensure_tiny_model() / "tokenizer.json"))
    args = _args("--dataset", "prefix", "--num-prompts", "9", "--num-prefixes", "3", "--prefix-len", "40",
                 "--suffix-len", "8")
    requests, _ = build_requests(args, np.random.default_rng(1))
    prefixes = [sentence_text_prompt(40, np.random.default_rng(1)) for _ in range(1)]
    assert requests[0].prompt.startswith(prefixes[0] + " ")  # the first prefix is drawn first
    for group in range(3):
        prompts = [r.prompt for r in requests if r.index % 3 == group]
        prefix = prompts[0][:prompts[0].rindex(".") + 1]
        assert prefix.endswith(".") and all(p.startswith(prefix + " ") for p in prompts)
        prefix_ids = tokenizer.encode(prefix, add_special_tokens=False).ids
        for prompt in prompts:
            assert tokenizer.encode(prompt, add_special_tokens=False).ids[:len(prefix_ids)] == prefix_ids


def test_sentence_text_prompt_is_about_n_tokens_of_sentences():
    text = sentence_text_prompt(64, np.random.default_rng(0))
    assert len(text.split()) == 56 and text.count(".") == 8 and text.endswith(".")
    assert sentence_text_prompt(1, np.random.default_rng(0)).count(" ") == 0


# ---------------------------------------------------------------- the hit rate from /metrics

METRICS_TEXT = """# HELP {p}:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE {p}:prefix_cache_queries_total counter
{p}:prefix_cache_queries_total{{engine="0",model_name="m {{x}}"}} 600.0
{p}:prefix_cache_queries_total{{engine="1"}} 400
{p}:prefix_cache_queries_created{{engine="0"}} 1.7e9
{p}:prefix_cache_hits_total{{engine="0"}} 250 1712345678000
{p}:prefix_cache_hits_total{{engine="1"}} 50
{p}:prefix_cache_hits_total_other 99
other_metric 3
"""


@pytest.mark.parametrize("prefix", ["dist_infer", "vllm"])
def test_cache_counters_are_summed_over_labels_for_either_prefix(prefix):
    assert parse_cache_counters(METRICS_TEXT.format(p=prefix)) == CacheCounters(1000.0, 300.0)


def test_cache_counters_absent_and_the_summary_of_two_scrapes():
    assert parse_cache_counters("") is None
    assert parse_cache_counters("# nothing\nvllm:num_requests_running 2\nprefix_cache_queries_total 5\n") is None
    assert parse_cache_counters("dist_infer:prefix_cache_queries_total 7\n") == CacheCounters(7.0, 0.0)
    before, after = CacheCounters(1000, 300), CacheCounters(1800, 900)
    assert cache_summary(before, after) == {"prefix_cache_hit_rate": 0.75, "prefix_cache_queries": 800,
                                            "prefix_cache_hits": 600}
    empty = {"prefix_cache_hit_rate": None, "prefix_cache_queries": None, "prefix_cache_hits": None}
    assert cache_summary(None, after) == empty and cache_summary(before, None) == empty
    assert cache_summary(after, before) == empty  # counters went back: the server restarted
    assert cache_summary(before, before) == empty  # nothing looked up
    assert "75.0%  (600 of 800 prompt tokens)" in cache_report_line(cache_summary(before, after))
    assert cache_report_line(empty).startswith("Prefix cache hit rate:") and "- (" in cache_report_line(empty)


# ---------------------------------------------------------------- per-turn TTFT


def test_ttft_by_turn_takes_medians_of_successful_turns():
    def record(turn, ttft, success=True):
        return RequestRecord(index=0, input_len=1, output_len=1, ttft=ttft, success=success, turn=turn)

    records = [record(1, 0.1), record(1, 0.3), record(1, 0.2), record(2, 0.4), record(2, 9.0, success=False),
               record(3, None, success=False)]
    by_turn = ttft_by_turn(records)
    assert by_turn["ttft_ms_by_turn"] == {"1": pytest.approx(200.0), "2": pytest.approx(400.0), "3": None}
    assert by_turn["completed_by_turn"] == {"1": 3, "2": 1, "3": 0}
    lines = turn_report_lines(by_turn)
    assert lines[0].split() == ["turn", "completed", "TTFT", "median", "vs", "turn", "1"]
    assert lines[2].split() == ["2", "1", "400.00", "2.00x"] and lines[3].split() == ["3", "0", "-", "-"]
    assert ttft_by_turn([RequestRecord(index=0, input_len=1, output_len=1)])["ttft_ms_by_turn"] == {}


# ---------------------------------------------------------------- a fake server that remembers conversations


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def make_chat_server(key: Callable[[dict], object], metrics: Optional[str] = "dist_infer", token_ids: bool = True,
                     ttft_step_s: float = 0.0):
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
        return PlainTextResponse(f'{metrics}:prefix_cache_queries_total{{engine="0"}} {q - 100}\n'
                                 f'{metrics}:prefix_cache_queries_total{{engine="1"}} 100\n'
                                 f'{metrics}:prefix_cache_hits_total{{engine="0"}} {h}\n')

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
            yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": len(prompt),
                                                                  "completion_tokens": len(ids)}}) + "\n\n"
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
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = server.force_exit = True
        thread.join(15)
        sock.close()


def _turns_are_sequential(seen) -> None:
    """Within a conversation, each turn arrived after the one before had finished streaming."""
    by_conversation = {}
    for conversation, turn, started, ended in seen["spans"]:
        by_conversation.setdefault(conversation, []).append((turn, started, ended))
    for spans in by_conversation.values():
        spans.sort()
        assert [turn for turn, _, _ in spans] == list(range(1, len(spans) + 1))
        for (_, _, ended), (_, started, _) in zip(spans, spans[1:]):
            assert started >= ended


# ---------------------------------------------------------------- multi-turn runs


def test_synthetic_multiturn_with_ids_sends_whole_conversations_turn_by_turn(tmp_path, capsys):
    prefix_len, suffix_len, output_len, turns = 12, 5, 4, 4
    app, seen, _ = make_chat_server(key=lambda body: tuple(body["prompt"][:prefix_len + suffix_len]),
                                    ttft_step_s=0.03)
    results = tmp_path / "records.json"
    with serving(app) as url:
        code = main(["--url", url, "--dataset", "multiturn", "--prompt-ids", "--num-prompts", "5", "--turns",
                     str(turns), "--prefix-len", str(prefix_len), "--suffix-len", str(suffix_len), "--output-len",
                     str(output_len), "--num-prefixes", "2", "--request-rate", "50", "--max-concurrency", "3",
                     "--json", "--save-results", str(results)])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = _last_json(out)
    assert summary["num_conversations"] == 5 and summary["num_prompts"] == 20 and summary["completed"] == 20
    assert summary["completed_by_turn"] == {str(t): 5 for t in range(1, turns + 1)}
    medians = summary["ttft_ms_by_turn"]
    assert list(medians) == ["1", "2", "3", "4"]
    assert all(medians[str(t)] >= 30.0 * t for t in range(1, turns + 1))  # the fake's first-token wait
    assert "vs turn 1" in out and "Prefix cache hit rate:" in out

    bodies, answers = seen["bodies"], seen["answers"]
    assert all(b["return_token_ids"] is True and b["max_tokens"] == output_len for b in bodies)
    by_number = {}
    for number, body in enumerate(bodies):
        by_number.setdefault(tuple(body["prompt"][:prefix_len + suffix_len]), []).append(number)
    assert sorted(len(numbers) for numbers in by_number.values()) == [turns] * 5
    systems = {tuple(bodies[numbers[0]]["prompt"][:prefix_len]) for numbers in by_number.values()}
    assert len(systems) == 2  # --num-prefixes system prompts shared by the conversations
    for numbers in by_number.values():
        for k, (this, following) in enumerate(zip(numbers, numbers[1:]), start=1):
            grown = bodies[this]["prompt"] + answers[this]["ids"]  # the conversation so far, the answer's ids
            assert bodies[following]["prompt"][:len(grown)] == grown
            assert len(bodies[following]["prompt"]) == len(grown) + suffix_len
        assert len(bodies[numbers[0]]["prompt"]) == prefix_len + suffix_len
    _turns_are_sequential(seen)

    # the fake's counters: every prompt's longest common prefix with an earlier one over all prompt ids
    queries = sum(len(b["prompt"]) for b in bodies)
    assert summary["prefix_cache_queries"] == queries
    assert summary["prefix_cache_hit_rate"] == pytest.approx(summary["prefix_cache_hits"] / queries)
    assert 0.5 < summary["prefix_cache_hit_rate"] < 1.0
    records = json.loads(results.read_text())["requests"]
    assert sorted((r["conversation"], r["turn"]) for r in records) == [(c, t) for c in range(5)
                                                                        for t in range(1, turns + 1)]
    assert sorted(r["index"] for r in records) == list(range(20))
    for r in records:  # input_len: the server's usage (this fake counts the prompt's ids)
        assert r["prompt_tokens"] == prefix_len + r["turn"] * suffix_len + (r["turn"] - 1) * output_len


def _sharegpt(tmp_path) -> str:
    conversations = []
    for i in range(4):
        turns = [{"from": "system", "value": "You are terse."}] if i % 2 else []
        for k in range(2 + i):  # 2..5 answered turns
            turns += [{"from": "human", "value": f"question {k} of chat {i}"},
                      {"from": "gpt", "value": "word " * (k + 2)}]
        conversations.append({"id": str(i), "conversations": turns})
    conversations.append({"id": "lonely", "conversations": [{"from": "gpt", "value": "hello?"}]})
    path = tmp_path / "share.json"
    path.write_text(json.dumps(conversations))
    return str(path)


def test_sharegpt_multiturn_on_chat_sends_the_growing_message_list(tmp_path, capsys):
    def first_user(body):
        return next(m["content"] for m in body["messages"] if m["role"] == "user")

    app, seen, _ = make_chat_server(key=first_user, metrics="vllm")
    with serving(app) as url:
        code = main(["--url", url, "--endpoint", "chat", "--dataset", _sharegpt(tmp_path), "--multiturn",
                     "--turns", "4", "--num-prompts", "10", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = _last_json(out)
    assert summary["num_conversations"] == 4 and summary["completed"] == 2 + 3 + 4 + 4  # --turns 4 caps at 4
    assert summary["completed_by_turn"] == {"1": 4, "2": 4, "3": 3, "4": 2}
    assert summary["prefix_cache_hit_rate"] is not None  # vLLM's counter names
    bodies, answers = seen["bodies"], seen["answers"]
    for number, body in enumerate(bodies):
        messages = body["messages"]
        turn = sum(m["role"] == "user" for m in messages)
        assert messages[-1]["role"] == "user" and messages[-1]["content"].startswith(f"question {turn - 1} of chat")
        assert body["max_tokens"] == round((turn + 1) * 1.3)  # the dataset's reply: words x 1.3
        assert (messages[0] == {"role": "system", "content": "You are terse."}) == ("chat 1" in messages[-1]["content"]
                                                                                    or "chat 3" in messages[-1]["content"])
        assert "return_token_ids" not in body
        for message in messages:  # every earlier answer is what the server streamed, not the dataset's
            if message["role"] == "assistant":
                assert message["content"] in [a["text"] for a in answers[:number]]
    _turns_are_sequential(seen)


def test_text_completions_multiturn_appends_the_answer_text(capsys):
    app, seen, _ = make_chat_server(key=lambda body: body["prompt"].split(TEXT_SEPARATOR)[1][:40], metrics=None)
    with serving(app) as url:
        code = main(["--url", url, "--dataset", "multiturn", "--num-prompts", "3", "--turns", "3", "--prefix-len",
                     "16", "--suffix-len", "6", "--output-len", "3", "--num-prefixes", "1", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = _last_json(out)
    assert summary["completed"] == 9 and summary["prefix_cache_hit_rate"] is None  # /metrics: 404
    assert "- (the server's /metrics has no prefix cache counters)" in out
    bodies, answers = seen["bodies"], seen["answers"]
    assert len({b["prompt"].split(TEXT_SEPARATOR)[0] for b in bodies}) == 1  # one system prompt for all
    for number, body in enumerate(bodies):
        later = [n for n in range(number + 1, len(bodies)) if bodies[n]["prompt"].startswith(body["prompt"])]
        if later:  # the next turn: this prompt, its answer, the separator and the next user message
            assert bodies[later[0]]["prompt"].startswith(body["prompt"] + answers[number]["text"] + TEXT_SEPARATOR)
    assert summary["completed_by_turn"] == {"1": 3, "2": 3, "3": 3}


def test_answers_without_ids_end_an_ids_conversation_and_max_input_len_ends_long_ones(capsys):
    app, seen, _ = make_chat_server(key=lambda body: tuple(body["prompt"][:10]), token_ids=False, metrics="none")
    with serving(app) as url:
        code = main(["--url", url, "--dataset", "multiturn", "--prompt-ids", "--num-prompts", "3", "--turns", "3",
                     "--prefix-len", "5", "--suffix-len", "5", "--output-len", "2", "--json"])
        out = capsys.readouterr().out
        assert code == 0, out
        assert _last_json(out)["completed_by_turn"] == {"1": 3}  # no ids to append: each stops after turn 1
        assert _last_json(out)["prefix_cache_hit_rate"] is None  # /metrics without the counters
        app2, seen2, _ = make_chat_server(key=lambda body: tuple(body["prompt"][:10]))
    with serving(app2) as url:
        code = main(["--url", url, "--dataset", "multiturn", "--prompt-ids", "--num-prompts", "2", "--turns", "5",
                     "--prefix-len", "5", "--suffix-len", "5", "--output-len", "2", "--max-input-len", "24",
                     "--json"])
    summary = _last_json(capsys.readouterr().out)
    assert code == 0
    # turn k's prompt: 5 + 5k + 2(k - 1) ids: 10, 17, 24, 31: turn 4 would pass 24
    assert summary["completed_by_turn"] == {"1": 2, "2": 2, "3": 2}
    assert max(len(b["prompt"]) for b in seen2["bodies"]) == 24


def test_prefix_dataset_run_reports_the_hit_rate(capsys):
    app, seen, counters = make_chat_server(key=lambda body: tuple(body["prompt"][:8]))
    with serving(app) as url:
        code = main(["--url", url, "--dataset", "prefix", "--prompt-ids", "--num-prompts", "8", "--num-prefixes",
                     "2", "--prefix-len", "8", "--suffix-len", "4", "--output-len", "2", "--max-concurrency", "1",
                     "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = _last_json(out)
    assert summary["prefix_cache_queries"] == 8 * 12 == counters["queries"] - 1000
    # one at a time: the first request of each prefix hits nothing, the other six their prefix (or more)
    assert summary["prefix_cache_hits"] >= 6 * 8
    assert summary["ttft_ms_by_turn"] is None and summary["num_conversations"] is None
    assert "vs turn 1" not in out


def test_sharegpt_turns_pairs_users_with_replies():
    system, pairs = sharegpt_turns([{"from": "gpt", "value": "hi"}, {"from": "system", "value": "be nice"},
                                    {"from": "human", "value": "a"}, {"from": "human", "value": "b"},
                                    {"from": "gpt", "value": "c"}, {"from": "user", "value": "d"},
                                    {"from": "assistant", "value": "e"}, {"from": "human", "value": "f"}])
    assert system == "be nice" and pairs == [("a\nb", "c"), ("d", "e")]
    assert sharegpt_turns([{"from": "human", "value": "x"}, {"from": "gpt", "value": " "},
                           {"from": "human", "value": "y"}, {"from": "gpt", "value": "z"}]) == (None, [])


def test_multiturn_flags_that_cannot_work_exit_2(tmp_path, capsys):
    assert main(["--url", "http://127.0.0.1:9", "--multiturn"]) == 2
    assert "--dataset multiturn" in capsys.readouterr().err
    assert main(["--url", "http://127.0.0.1:9", "--dataset", "multiturn", "--endpoint", "chat", "--prompt-ids"]) == 2
    assert "--prompt-ids needs --endpoint completions" in capsys.readouterr().err
    share = _sharegpt(tmp_path)
    with pytest.raises(InputError, match="needs --tokenizer"):
        build_conversations(_args("--dataset", share, "--multiturn", "--prompt-ids"), np.random.default_rng(0))
    conversations, arrivals = build_conversations(_args("--dataset", share, "--multiturn", "--turns", "9",
                                                        "--request-rate", "2"), np.random.default_rng(0))
    assert sorted(len(c.turns) for c in conversations) == [2, 3, 4, 5] and arrivals.startswith("Poisson at 2 req/s")
    assert [c.index for c in conversations] == [0, 1, 2, 3] and conversations[0].arrival_s == 0.0
