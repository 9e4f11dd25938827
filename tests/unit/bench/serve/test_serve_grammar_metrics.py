"""The grammar's share of step time from /metrics: the counters summed over instances, the
summary of two scrapes (None without counters or after a restart), and a --dataset json-schema run
against a fake server that answers each schema's example, one invalid answer and one cut short."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from dist_infer.bench.serve.command import main
from dist_infer.bench.serve.grammar_metrics import grammar_report_line, grammar_summary, parse_grammar_counters
from dist_infer.bench.serve.json_schemas import schema_cases
from tests.support.bench_serve_inputs import last_json
from tests.support.fake_openai_servers import serving


def exposition(mask: float, wait: float, rows: int, step: float) -> str:
    return (
        "# TYPE dist_infer:structured_mask_seconds_total counter\n"
        f'dist_infer:structured_mask_seconds_total{{engine="0",model_name="m"}} {mask / 2}\n'
        f'dist_infer:structured_mask_seconds_total{{engine="1",model_name="m"}} {mask / 2}\n'
        f'dist_infer:structured_mask_wait_seconds_total{{engine="0",model_name="m"}} {wait}\n'
        f'dist_infer:structured_mask_rows_total{{engine="0",model_name="m"}} {rows}\n'
        f'dist_infer:step_duration_seconds_sum{{engine="0",kind="decode",model_name="m"}} {step / 4}\n'
        f'dist_infer:step_duration_seconds_sum{{engine="0",kind="mixed",model_name="m"}} {3 * step / 4}\n'
        f'dist_infer:step_duration_seconds_count{{engine="0",kind="mixed",model_name="m"}} 99\n'
    )


def test_two_scrapes_give_the_share_and_what_was_hidden():
    before = parse_grammar_counters(exposition(1.0, 0.5, 10, 20.0))
    after = parse_grammar_counters(exposition(3.0, 1.0, 50, 60.0))
    got = grammar_summary(before, after)
    assert got["grammar_mask_s"] == 2.0 and got["grammar_step_s"] == 40.0 and got["grammar_masked_rows"] == 40
    assert got["grammar_share_of_step"] == pytest.approx(0.05) and got["grammar_hidden"] == pytest.approx(0.75)
    assert "5.0% of step time, 75% hidden" in grammar_report_line(got)


@pytest.mark.parametrize(
    "before,after",
    [(None, "x"), ("x", None), ("other_metric 1\n", "other_metric 2\n"), ("after", "before")],
)
def test_no_share_without_counters_or_after_a_restart(before, after):
    texts = {"x": exposition(1, 0, 1, 1), "before": exposition(1, 0, 1, 1), "after": exposition(5, 1, 9, 9)}
    got = grammar_summary(*(parse_grammar_counters(texts.get(t, t)) for t in (before, after)))
    assert set(got.values()) == {None} and grammar_report_line(got) is None


def schema_server(cases):
    """Answers request i with case i's example, streamed in 3 chunks; the schema named BAD with a
    JSON that does not validate, the one named CUT with half a JSON and finish_reason length."""
    app, seen = FastAPI(), []
    counters = {"mask": 0.0, "steps": 0.0}
    examples = {c.name: c.example for c in cases}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            exposition(counters["mask"], counters["mask"] / 4, int(counters["steps"]), 10 * counters["steps"])
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append(body)
        name = body["response_format"]["json_schema"]["name"]
        text, finish = json.dumps(examples[name]), "stop"
        if name == cases[1].name:
            text = json.dumps({"unexpected": True})
        if name == cases[2].name:
            text, finish = text[: len(text) // 2], "length"
        counters["mask"] += 0.5
        counters["steps"] += 1

        async def events():
            third = max(1, len(text) // 3)
            pieces = [text[:third], text[third : 2 * third], text[2 * third :]]
            for j, piece in enumerate(pieces):
                choice = {"index": 0, "delta": {"content": piece}, "finish_reason": finish if j == 2 else None}
                yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
                await asyncio.sleep(0)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app, seen


def test_a_json_schema_run_checks_every_answer(capsys):
    cases = schema_cases(9, seed=4)
    app, seen = schema_server(cases)
    with serving(app) as url:
        args = ["--url", url, "--endpoint", "chat", "--dataset", "json-schema", "--num-prompts", "9", "--seed", "4"]
        code = main(args + ["--temperature", "1", "--max-concurrency", "3", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = last_json(out)
    assert len(seen) == 9 and all(
        b["temperature"] == 1.0 and b["response_format"]["json_schema"]["strict"] for b in seen
    )
    assert summary["schema_answers"] == 9 and summary["schema_truncated"] == 1 and summary["schema_valid"] == 7
    assert summary["schema_validity_rate"] == pytest.approx(7 / 8)
    (error,) = summary["schema_errors"]
    assert error.startswith("does not validate: "), error
    assert summary["grammar_masked_rows"] == 9 and summary["grammar_hidden"] == pytest.approx(0.75)
    assert "Schema validity:" in out and "87.5%  (7 valid of 8 that ended; 1 cut by max_tokens)" in out
    assert "Grammar time:" in out and "invalid x1: does not validate" in out
