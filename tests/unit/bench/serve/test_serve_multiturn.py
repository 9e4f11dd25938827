"""Multi-turn replay: per-turn TTFT medians, and runs against a fake server that remembers
conversations (tests/support/fake_openai_servers.py): whole conversations sent turn by turn with
the answers' ids, ShareGPT chats as growing message lists, text completions with the answer text
appended, conversations ended by answers without ids or by --max-input-len. Timing is only checked
as lower bounds the fake server itself imposes (the machine is shared)."""

from __future__ import annotations

import json

import pytest

from dist_infer.bench.serve.client import RequestRecord
from dist_infer.bench.serve.command import main
from dist_infer.bench.serve.multiturn import TEXT_SEPARATOR, ttft_by_turn, turn_report_lines
from tests.support.bench_serve_inputs import last_json, write_multiturn_sharegpt
from tests.support.fake_openai_servers import make_chat_server, serving


def test_ttft_by_turn_takes_medians_of_successful_turns():
    def record(turn, ttft, success=True):
        return RequestRecord(index=0, input_len=1, output_len=1, ttft=ttft, success=success, turn=turn)

    records = [
        record(1, 0.1),
        record(1, 0.3),
        record(1, 0.2),
        record(2, 0.4),
        record(2, 9.0, success=False),
        record(3, None, success=False),
    ]
    by_turn = ttft_by_turn(records)
    assert by_turn["ttft_ms_by_turn"] == {"1": pytest.approx(200.0), "2": pytest.approx(400.0), "3": None}
    assert by_turn["completed_by_turn"] == {"1": 3, "2": 1, "3": 0}
    lines = turn_report_lines(by_turn)
    assert lines[0].split() == ["turn", "completed", "TTFT", "median", "vs", "turn", "1"]
    assert lines[2].split() == ["2", "1", "400.00", "2.00x"] and lines[3].split() == ["3", "0", "-", "-"]
    assert ttft_by_turn([RequestRecord(index=0, input_len=1, output_len=1)])["ttft_ms_by_turn"] == {}


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


def test_synthetic_multiturn_with_ids_sends_whole_conversations_turn_by_turn(tmp_path, capsys):
    prefix_len, suffix_len, output_len, turns = 12, 5, 4, 4
    app, seen, _ = make_chat_server(key=lambda body: tuple(body["prompt"][: prefix_len + suffix_len]), ttft_step_s=0.03)
    results = tmp_path / "records.json"
    with serving(app) as url:
        code = main(
            [
                "--url",
                url,
                "--dataset",
                "multiturn",
                "--prompt-ids",
                "--num-prompts",
                "5",
                "--turns",
                str(turns),
                "--prefix-len",
                str(prefix_len),
                "--suffix-len",
                str(suffix_len),
                "--output-len",
                str(output_len),
                "--num-prefixes",
                "2",
                "--request-rate",
                "50",
                "--max-concurrency",
                "3",
                "--json",
                "--save-results",
                str(results),
            ]
        )
    out = capsys.readouterr().out
    assert code == 0, out
    summary = last_json(out)
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
        by_number.setdefault(tuple(body["prompt"][: prefix_len + suffix_len]), []).append(number)
    assert sorted(len(numbers) for numbers in by_number.values()) == [turns] * 5
    systems = {tuple(bodies[numbers[0]]["prompt"][:prefix_len]) for numbers in by_number.values()}
    assert len(systems) == 2  # --num-prefixes system prompts shared by the conversations
    for numbers in by_number.values():
        for k, (this, following) in enumerate(zip(numbers, numbers[1:]), start=1):
            grown = bodies[this]["prompt"] + answers[this]["ids"]  # the conversation so far, the answer's ids
            assert bodies[following]["prompt"][: len(grown)] == grown
            assert len(bodies[following]["prompt"]) == len(grown) + suffix_len
        assert len(bodies[numbers[0]]["prompt"]) == prefix_len + suffix_len
    _turns_are_sequential(seen)

    # the fake's counters: every prompt's longest common prefix with an earlier one over all prompt ids
    queries = sum(len(b["prompt"]) for b in bodies)
    assert summary["prefix_cache_queries"] == queries
    assert summary["prefix_cache_hit_rate"] == pytest.approx(summary["prefix_cache_hits"] / queries)
    assert 0.5 < summary["prefix_cache_hit_rate"] < 1.0
    records = json.loads(results.read_text())["requests"]
    assert sorted((r["conversation"], r["turn"]) for r in records) == [
        (c, t) for c in range(5) for t in range(1, turns + 1)
    ]
    assert sorted(r["index"] for r in records) == list(range(20))
    for r in records:  # input_len: the server's usage (this fake counts the prompt's ids)
        assert r["prompt_tokens"] == prefix_len + r["turn"] * suffix_len + (r["turn"] - 1) * output_len


def test_sharegpt_multiturn_on_chat_sends_the_growing_message_list(tmp_path, capsys):
    def first_user(body):
        return next(m["content"] for m in body["messages"] if m["role"] == "user")

    app, seen, _ = make_chat_server(key=first_user, metrics="vllm")
    with serving(app) as url:
        code = main(
            [
                "--url",
                url,
                "--endpoint",
                "chat",
                "--dataset",
                write_multiturn_sharegpt(tmp_path),
                "--multiturn",
                "--turns",
                "4",
                "--num-prompts",
                "10",
                "--json",
            ]
        )
    out = capsys.readouterr().out
    assert code == 0, out
    summary = last_json(out)
    assert summary["num_conversations"] == 4 and summary["completed"] == 2 + 3 + 4 + 4  # --turns 4 caps at 4
    assert summary["completed_by_turn"] == {"1": 4, "2": 4, "3": 3, "4": 2}
    assert summary["prefix_cache_hit_rate"] is not None  # vLLM's counter names
    bodies, answers = seen["bodies"], seen["answers"]
    for number, body in enumerate(bodies):
        messages = body["messages"]
        turn = sum(m["role"] == "user" for m in messages)
        assert messages[-1]["role"] == "user" and messages[-1]["content"].startswith(f"question {turn - 1} of chat")
        assert body["max_tokens"] == round((turn + 1) * 1.3)  # the dataset's reply: words x 1.3
        assert (messages[0] == {"role": "system", "content": "You are terse."}) == (
            "chat 1" in messages[-1]["content"] or "chat 3" in messages[-1]["content"]
        )
        assert "return_token_ids" not in body
        for message in messages:  # every earlier answer is what the server streamed, not the dataset's
            if message["role"] == "assistant":
                assert message["content"] in [a["text"] for a in answers[:number]]
    _turns_are_sequential(seen)


def test_text_completions_multiturn_appends_the_answer_text(capsys):
    app, seen, _ = make_chat_server(key=lambda body: body["prompt"].split(TEXT_SEPARATOR)[1][:40], metrics=None)
    with serving(app) as url:
        code = main(
            [
                "--url",
                url,
                "--dataset",
                "multiturn",
                "--num-prompts",
                "3",
                "--turns",
                "3",
                "--prefix-len",
                "16",
                "--suffix-len",
                "6",
                "--output-len",
                "3",
                "--num-prefixes",
                "1",
                "--json",
            ]
        )
    out = capsys.readouterr().out
    assert code == 0, out
    summary = last_json(out)
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
        code = main(
            [
                "--url",
                url,
                "--dataset",
                "multiturn",
                "--prompt-ids",
                "--num-prompts",
                "3",
                "--turns",
                "3",
                "--prefix-len",
                "5",
                "--suffix-len",
                "5",
                "--output-len",
                "2",
                "--json",
            ]
        )
        out = capsys.readouterr().out
        assert code == 0, out
        assert last_json(out)["completed_by_turn"] == {"1": 3}  # no ids to append: each stops after turn 1
        assert last_json(out)["prefix_cache_hit_rate"] is None  # /metrics without the counters
        app2, seen2, _ = make_chat_server(key=lambda body: tuple(body["prompt"][:10]))
    with serving(app2) as url:
        code = main(
            [
                "--url",
                url,
                "--dataset",
                "multiturn",
                "--prompt-ids",
                "--num-prompts",
                "2",
                "--turns",
                "5",
                "--prefix-len",
                "5",
                "--suffix-len",
                "5",
                "--output-len",
                "2",
                "--max-input-len",
                "24",
                "--json",
            ]
        )
    summary = last_json(capsys.readouterr().out)
    assert code == 0
    # turn k's prompt: 5 + 5k + 2(k - 1) ids: 10, 17, 24, 31: turn 4 would pass 24
    assert summary["completed_by_turn"] == {"1": 2, "2": 2, "3": 2}
    assert max(len(b["prompt"]) for b in seen2["bodies"]) == 24
