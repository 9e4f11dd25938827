"""/health latency while big prompts arrive: does the API keep answering while
it reads, parses and tokenizes them?

Three processes, so that no client's own GIL shows up in the figures: the server (the real app from
`build_app` over a stub engine that holds the model's real tokenizer and nothing behind it, so what
is measured is the API's work before a request reaches an engine), a sender that posts `--prompts`
prompts of `--chars` characters at once, and this process, which probes /health every
`--probe-interval` seconds until the sender is done and prints one JSON line:

    python benchmarks/health_under_big_prompts.py --chars 14000000 --prompts 3
    python benchmarks/health_under_big_prompts.py --chars 671744 --max-model-len 8192   # the largest that passes
    python benchmarks/health_under_big_prompts.py --kind ids --chars 15000000 --prompts 3   # ~15 MB of token ids

The prompt text is this repository's own Python source, repeated (prose-like code, as a real
tokenizer sees it). `--model` is a checkpoint or GGUF with a tokenizer (default: the SmolLM2 GGUF
of the `default` model). Check `uptime` before and after: a figure counts only on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class StubEngine:
    """The engine interface (serving/http/api_server.py) with a real tokenizer and no model: a prompt that
    fits gets one token back at once."""

    model_name = "stub"
    dead_reason = None

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.vocab_size = tokenizer.vocab_size
        self.chat_template = tokenizer.chat_template

    def check_request(self, prompt_token_ids, params) -> None:
        from dist_infer.engine.request import check_prompt

        check_prompt(prompt_token_ids, params, self.vocab_size, self.max_model_len)

    async def generate(self, request_id, prompt_token_ids, params):
        from dist_infer.engine.request import RequestOutput

        yield RequestOutput(request_id, [2], [0.0], [], "", True, "stop", None, len(prompt_token_ids), 1)

    def abort(self, request_id) -> None:
        pass

    def stats(self) -> dict:
        return {
            "num_requests_running": 0,
            "num_requests_waiting": 0,
            "kv_cache_usage_perc": 0.0,
            "num_preemptions_total": 0,
            "free_blocks": 1,
            "total_blocks": 1,
        }

    def begin_shutdown(self) -> None:
        pass


def serve(args) -> None:
    from dist_infer.engine.tokenizer import TextTokenizer
    from dist_infer.models.builtin import resolve_model
    from dist_infer.serving.http.api_server import build_app, serve_http

    engine = StubEngine(TextTokenizer(resolve_model(args.model)), args.max_model_len)
    serve_http(
        build_app(engine, "stub", warm_workers=True),
        "127.0.0.1",
        0,
        on_ready=lambda host, port: Path(args.ready).write_text(str(port)),
    )


def prompt_text(chars: int) -> str:
    source = "".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "dist_infer").rglob("*.py")))
    return (source * (chars // len(source) + 1))[:chars]


def body_of(kind: str, chars: int) -> bytes:
    if kind == "ids":  # token ids written as JSON until the body has `chars` bytes
        count = chars // 7  # "12345, "
        return json.dumps({"prompt": [10000 + i % 39000 for i in range(count)], "max_tokens": 1}).encode()
    if kind == "chat":
        return json.dumps({"messages": [{"role": "user", "content": prompt_text(chars)}], "max_tokens": 1}).encode()
    return json.dumps({"prompt": prompt_text(chars), "max_tokens": 1}).encode()


def send(args) -> None:
    """Post the prompts at once (bodies made before the clock starts); print each answer as JSON."""
    import httpx

    path = "/v1/chat/completions" if args.kind == "chat" else "/v1/completions"
    body = body_of(args.kind, args.chars)
    results = [None] * args.prompts

    def post(i: int) -> None:
        start = time.perf_counter()
        with httpx.Client(trust_env=False, timeout=600) as http:
            r = http.post(args.url + path, content=body, headers={"Content-Type": "application/json"})
        message = r.json().get("error", {}).get("message", "") if r.status_code != 200 else ""
        results[i] = {
            "status": r.status_code,
            "seconds": round(time.perf_counter() - start, 3),
            "message": message[:160],
        }

    print(json.dumps({"body_bytes": len(body)}), flush=True)
    threads = [threading.Thread(target=post, args=(i,)) for i in range(args.prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(results), flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(args) -> dict:
    import httpx

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    me = [sys.executable, __file__, "--model", args.model, "--max-model-len", str(args.max_model_len)]
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "port"
        server = subprocess.Popen(me + ["--serve", "--ready", str(ready)], env=env)
        try:
            deadline = time.monotonic() + 120
            while not ready.exists() or not ready.read_text():
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the server did not start")
                time.sleep(0.1)
            url = f"http://127.0.0.1:{ready.read_text()}"
            sender = subprocess.Popen(
                me
                + [
                    "--send",
                    "--url",
                    url,
                    "--kind",
                    args.kind,
                    "--chars",
                    str(args.chars),
                    "--prompts",
                    str(args.prompts),
                ],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            first = json.loads(sender.stdout.readline())  # the body is made: the clock starts
            latencies, load = [], os.getloadavg()[0]
            with httpx.Client(trust_env=False, timeout=120) as http:
                while sender.poll() is None:
                    start = time.perf_counter()
                    status = http.get(url + "/health").status_code
                    latencies.append(time.perf_counter() - start)
                    assert status == 200, status
                    time.sleep(args.probe_interval)
            answers = json.loads(sender.stdout.read())
        finally:
            server.terminate()
            server.wait(60)
    ms = [1000 * s for s in latencies]
    return {
        "kind": args.kind,
        "chars": args.chars,
        "prompts": args.prompts,
        "max_model_len": args.max_model_len,
        "body_bytes": first["body_bytes"],
        "probes": len(ms),
        "health_p50_ms": round(percentile(ms, 0.5), 1),
        "health_p99_ms": round(percentile(ms, 0.99), 1),
        "health_max_ms": round(max(ms), 1),
        "answers": answers,
        "loadavg_before": round(load, 2),
        "loadavg_after": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="checkpoint or GGUF whose tokenizer the server uses")
    parser.add_argument("--max-model-len", type=int, default=8192, help="the stub engine's context length")
    parser.add_argument(
        "--kind",
        choices=("text", "chat", "ids"),
        default="text",
        help="a text prompt, one chat message, or a prompt of token ids",
    )
    parser.add_argument("--chars", type=int, default=14_000_000, help="characters per prompt (ids: body bytes)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts sent at once")
    parser.add_argument("--probe-interval", type=float, default=0.02, help="seconds between /health probes")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--send", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ready", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
    elif args.send:
        send(args)
    else:
        print(json.dumps(measure(args)))


if __name__ == "__main__":
    main()
