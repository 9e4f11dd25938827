"""`dist-infer bench-serve` as a whole: bad inputs exit 2 naming them before the run, and whole runs
against a tiny fake OpenAI streaming server (tests/support/fake_openai_servers.py). No timing
asserts: the machine is shared, so only counts, contents and shapes are checked."""

from __future__ import annotations

import json
import socket

from dist_infer.bench.serve.command import main
from dist_infer.bench.serve.datasets import approx_token_count
from tests.support.bench_serve_inputs import last_json
from tests.support.fake_openai_servers import make_fake_server, serving


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
    assert (
        f"--plot {tmp_path / 'no' / 'cdf.png'}: directory {tmp_path / 'no'} does not exist" in capsys.readouterr().err
    )


def test_unreachable_server_without_model_exits_2(capsys):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["--url", f"http://127.0.0.1:{port}", "--num-prompts", "2"]) == 2
    assert "/v1/models" in capsys.readouterr().err


def test_end_to_end_completions_json_plot_and_results(tmp_path, capsys):
    app, seen = make_fake_server()
    plot, results = tmp_path / "cdf.png", tmp_path / "records.json"
    with serving(app) as url:
        code = main(
            [
                "--url",
                url,
                "--num-prompts",
                "20",
                "--request-rate",
                "200",
                "--burstiness",
                "0.5",
                "--input-len",
                "16",
                "--output-len",
                "12",
                "--ignore-eos",
                "--slo",
                "ttft=60,e2e=120",
                "--json",
                "--plot",
                str(plot),
                "--save-results",
                str(results),
                "--seed",
                "3",
            ]
        )
    out = capsys.readouterr().out
    assert code == 0, out
    summary = last_json(out)
    assert summary["completed"] == 20 and summary["failed"] == 0
    assert summary["model"] == "fake-model"
    assert summary["total_output_tokens"] == sum(seen["sent"])
    assert summary["goodput"] is not None and summary["goodput"] > 0
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert summary[metric]["p99"] is not None
    assert "Request throughput" in out and "TTFT" in out

    bodies = seen["bodies"]
    assert len(bodies) == 20
    assert all(
        b["model"] == "fake-model"
        and b["stream"] is True
        and b["ignore_eos"] is True
        and b["stream_options"] == {"include_usage": True}
        and b["temperature"] == 0
        and isinstance(b["prompt"], str)
        for b in bodies
    )

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
    share.write_text(
        json.dumps(
            [
                {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}
                for question, answer in answers.items()
            ]
        )
    )
    with serving(app) as url:
        code = main(
            [
                "--url",
                url + "/v1/",
                "--model",
                "chat-model",
                "--endpoint",
                "chat",
                "--num-prompts",
                "20",
                "--request-rate",
                "300",
                "--dataset",
                str(share),
                "--max-input-len",
                "30",
                "--json",
                "--save-results",
                str(results),
            ]
        )
    out = capsys.readouterr().out
    assert code == 1  # the run finishes, and says some requests failed
    summary = last_json(out)
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
        code = main(
            [
                "--url",
                url,
                "--dataset",
                str(trace),
                "--time-scale",
                "0.05",
                "--num-prompts",
                "50",
                "--prompt-ids",
                "--vocab-size",
                "50",
                "--max-input-len",
                "20",
                "--max-concurrency",
                "3",
                "--json",
            ]
        )
    out = capsys.readouterr().out
    assert code == 0, out
    summary = last_json(out)
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
    summary = last_json(out)
    assert summary["completed"] == 4 and summary["failed"] == 2
    assert summary["errors"] == {"timed out after 2 s": 2}
    assert summary["total_output_tokens"] == sum(seen["sent"])
