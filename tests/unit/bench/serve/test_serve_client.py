"""The client's parsing: inter-token latencies of multi-token chunks, SSE lines, and each chunk's
content (completions, chat, token ids, usage, errors)."""

from __future__ import annotations

import pytest

from dist_infer.bench.serve.client import chunk_content, inter_token_latencies, parse_sse_line


def test_inter_token_latencies_split_multi_token_chunks():
    assert inter_token_latencies([0.0, 1.0, 3.0], [1, 1, 2]) == [1.0, 1.0, 1.0]
    assert inter_token_latencies([0.5], [3]) == []
    assert inter_token_latencies([], []) == []


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
    whole = chunk_content(
        {"choices": [{"message": {"role": "assistant", "content": "all of it"}}], "usage": {"completion_tokens": 3}}
    )
    assert (whole.text, whole.completion_tokens) == ("all of it", 3)
    error = chunk_content({"error": {"message": "out of memory", "code": 500}})
    assert error.error == "error in stream: out of memory"
