"""bench-serve's datasets: synthetic lengths with a long tail, ShareGPT (first human turn, first
reply), Azure and BurstGPT traces, errors that name the file, column and line, a tokenizer file,
and the shared-prefix dataset (exactly the prefix shared in k groups, reproducible by seed, text
prefixes that tokenize the same before any suffix)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dist_infer.bench.serve.arrivals import trace_offsets
from dist_infer.bench.serve.datasets import (
    approx_token_count,
    build_requests,
    load_sharegpt,
    load_tokenizer_counter,
    load_trace_csv,
    synthetic_lengths,
)
from dist_infer.bench.serve.flags import InputError
from dist_infer.bench.serve.prompts import sentence_text_prompt
from tests.support.bench_serve_inputs import bench_serve_args


def test_synthetic_lengths_have_a_long_tail_clipped_to_four_times_the_mean():
    lengths = synthetic_lengths(100_000, 128, np.random.default_rng(0))
    assert lengths.dtype.kind == "i"
    assert lengths.min() >= 1 and lengths.max() <= 4 * 128
    assert lengths.max() == 4 * 128  # the tail reaches the clip
    assert lengths.mean() == pytest.approx(128, rel=0.1)
    assert np.percentile(lengths, 99) > 2.5 * np.median(lengths)  # long tail, not a narrow bump
    tiny = synthetic_lengths(1000, 1, np.random.default_rng(0))
    assert tiny.min() == 1 and tiny.max() <= 4


def test_sharegpt_prompt_is_first_human_turn_and_output_is_first_gpt_reply(tmp_path):
    path = tmp_path / "share.json"
    path.write_text(
        json.dumps(
            [
                {
                    "id": "a",
                    "conversations": [
                        {"from": "human", "value": "tell me a story about cats"},
                        {"from": "gpt", "value": "once upon a time there were ten cats"},
                        {"from": "human", "value": "more"},
                        {"from": "gpt", "value": "no"},
                    ],
                },
                {"id": "b", "conversations": [{"from": "human", "value": "only a question"}]},
                {
                    "id": "c",
                    "conversations": [
                        {"from": "gpt", "value": "greeting first"},
                        {"from": "human", "value": "why"},
                        {"from": "gpt", "value": "because"},
                    ],
                },
                {"id": "d"},
            ]
        )
    )
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
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:47.1805900,879,0\n"
    )
    entries = load_trace_csv(path)
    assert [(e.input_len, e.output_len) for e in entries] == [(374, 44), (879, 1), (396, 109)]  # sorted by time
    offsets = trace_offsets([e.timestamp for e in entries])
    assert offsets.tolist() == pytest.approx([0.0, 0.5, 4.314579])


def test_burstgpt_trace_csv(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,0,1087,Conversation log\n"
        "118,GPT-4,417,276,693,API log\n"
    )
    entries = load_trace_csv(path)
    assert [(e.timestamp, e.input_len, e.output_len) for e in entries] == [
        (5.0, 472, 18),
        (45.0, 1087, 1),
        (118.0, 417, 276),
    ]
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


def test_tokenizer_file_counts_and_encodes(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    count, encode = load_tokenizer_counter(tmp_path)  # a directory holding tokenizer.json
    assert encode("hello world hello") == [1, 2, 1]
    assert count("hello there") == 2
    with pytest.raises(InputError, match="tokenizer file .*nothing does not exist"):
        load_tokenizer_counter(tmp_path / "nothing")


def test_prefix_dataset_requests_share_exactly_the_prefix_in_k_groups():
    args = bench_serve_args(
        "--dataset",
        "prefix",
        "--prompt-ids",
        "--num-prompts",
        "14",
        "--num-prefixes",
        "4",
        "--prefix-len",
        "16",
        "--suffix-len",
        "6",
        "--output-len",
        "9",
        "--request-rate",
        "5",
    )
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
        args = bench_serve_args(
            "--dataset",
            "prefix",
            "--num-prompts",
            "6",
            "--num-prefixes",
            "2",
            "--prefix-len",
            "12",
            "--suffix-len",
            "3",
            *extra,
        )
        a, _ = build_requests(args, np.random.default_rng(5))
        b, _ = build_requests(args, np.random.default_rng(5))
        c, _ = build_requests(args, np.random.default_rng(6))
        assert a == b and a != c


def test_text_prefix_tokenizes_the_same_before_any_suffix():
    """The tiny model's byte-level BPE sees the same leading ids in every request of a group."""
    from tokenizers import Tokenizer

    from dist_infer.models.tiny_model import ensure_tiny_model

    tokenizer = Tokenizer.from_file(str(ensure_tiny_model() / "tokenizer.json"))
    args = bench_serve_args(
        "--dataset", "prefix", "--num-prompts", "9", "--num-prefixes", "3", "--prefix-len", "40", "--suffix-len", "8"
    )
    requests, _ = build_requests(args, np.random.default_rng(1))
    prefixes = [sentence_text_prompt(40, np.random.default_rng(1)) for _ in range(1)]
    assert requests[0].prompt.startswith(prefixes[0] + " ")  # the first prefix is drawn first
    for group in range(3):
        prompts = [r.prompt for r in requests if r.index % 3 == group]
        prefix = prompts[0][: prompts[0].rindex(".") + 1]
        assert prefix.endswith(".") and all(p.startswith(prefix + " ") for p in prompts)
        prefix_ids = tokenizer.encode(prefix, add_special_tokens=False).ids
        for prompt in prompts:
            assert tokenizer.encode(prompt, add_special_tokens=False).ids[: len(prefix_ids)] == prefix_ids


def test_the_json_schema_dataset_asks_for_its_schemas_or_with_unconstrained_the_same_prompts_bare():
    import argparse

    from dist_infer.bench.serve.client import request_payload

    parser = argparse.ArgumentParser()
    from dist_infer.bench.serve.flags import add_bench_serve_flags

    add_bench_serve_flags(parser)
    args = parser.parse_args(["--dataset", "json-schema", "--num-prompts", "5", "--seed", "2", "--output-len", "200"])
    strict, _ = build_requests(args, np.random.default_rng(0))
    args.unconstrained = True
    bare, _ = build_requests(args, np.random.default_rng(0))
    assert [r.prompt for r in strict] == [r.prompt for r in bare] and len(strict) == 5
    assert all(r.schema is not None and r.output_len == 200 for r in strict) and all(r.schema is None for r in bare)
    body = request_payload(strict[0], "m", "chat", False, temperature=1.0)
    assert body["response_format"]["json_schema"]["schema"] == strict[0].schema.schema and body["temperature"] == 1.0
    assert "response_format" not in request_payload(bare[0], "m", "chat", False)
    args.prompt_ids = True
    with pytest.raises(InputError, match="drop --prompt-ids"):
        build_requests(args, np.random.default_rng(0))


def test_replayed_lengths_come_from_a_saved_run_and_a_bad_file_is_named(tmp_path):
    import argparse

    from dist_infer.bench.serve.flags import add_bench_serve_flags

    saved = tmp_path / "run.json"
    saved.write_text(
        json.dumps(
            {
                "summary": {},
                "requests": [
                    {"index": 0, "success": True, "output_tokens": 17},
                    {"index": 1, "success": False, "output_tokens": 3},
                    {"index": 2, "success": True, "output_tokens": 0},
                ],
            }
        )
    )
    parser = argparse.ArgumentParser()
    add_bench_serve_flags(parser)
    args = parser.parse_args(
        ["--dataset", "json-schema", "--num-prompts", "3", "--unconstrained", "--replay-lengths", str(saved)]
    )
    requests, _ = build_requests(args, np.random.default_rng(0))
    assert [r.output_len for r in requests] == [17, args.output_len, 1]
    (tmp_path / "bad.json").write_text("{}")
    args.replay_lengths = str(tmp_path / "bad.json")
    with pytest.raises(InputError, match="bad.json: not a readable --save-results file"):
        build_requests(args, np.random.default_rng(0))


@pytest.mark.parametrize("kind", ["copy", "write"])
def test_the_copy_and_write_datasets_are_text_tasks_made_from_the_seed(kind):
    import argparse

    from dist_infer.bench.serve.flags import add_bench_serve_flags

    parser = argparse.ArgumentParser()
    add_bench_serve_flags(parser)
    args = parser.parse_args(["--dataset", kind, "--num-prompts", "12", "--seed", "3", "--output-len", "128"])
    first, _ = build_requests(args, np.random.default_rng(3))
    again, _ = build_requests(args, np.random.default_rng(3))
    other, _ = build_requests(args, np.random.default_rng(4))
    assert [r.prompt for r in first] == [r.prompt for r in again], "the same seed sends the same requests"
    assert [r.prompt for r in first] != [r.prompt for r in other], "a new seed fresh ones"
    assert len(first) == 12 and all(isinstance(r.prompt, str) and r.output_len == 128 for r in first)
    args.prompt_ids = True
    with pytest.raises(InputError, match="drop --prompt-ids"):
        build_requests(args, np.random.default_rng(0))
