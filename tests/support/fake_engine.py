"""A fake engine for the HTTP API's tests: the engine interface the server codes against
(serving/http/api_server.py's docstring) with deterministic tokens. It "generates" token
i = 32 + (sum(prompt) + i) % 90 (printable characters for the one-character-per-token fake
tokenizer), a short sleep per token, honours max_tokens, stop_token_ids and abort, and counts KV
blocks, so the tests can check exact tokens, that a client that leaves aborts its request, and
that every block comes back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

from dist_infer.engine.request import RequestError, RequestOutput
from dist_infer.serving.fleet.interface import EngineDeadError, QueueFullError
from dist_infer.serving.http.api_server import build_app, serve_http

MODEL = "fake-model"
MAX_MODEL_LEN = 128
VOCAB = 1000
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('must start with a user turn') }}"
    "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def fake_tokens(prompt_ids: list[int], n: int) -> list[int]:
    return [32 + (sum(prompt_ids) + i) % 90 for i in range(n)]


class FakeTokenizer:
    """One printable ASCII character per token (id = its code); BOS 1, EOS 2."""

    bos_id, eos_id = 1, 2

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [ord(c) if 32 <= ord(c) < 127 else ord("?") for c in text]
        return [self.bos_id] + ids if add_bos else ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return "".join(chr(i) for i in ids if 32 <= i < 127)

    def token(self, token_id: int) -> str:
        return {1: "<s>", 2: "</s>"}.get(token_id, chr(token_id) if 32 <= token_id < 127 else f"<{token_id}>")


class FakeEngine:
    """The EngineClient interface with deterministic tokens (see the module docstring)."""

    model_name = MODEL
    block_size = 4
    total_blocks = 512

    def __init__(self):
        self.max_model_len = MAX_MODEL_LEN
        self.vocab_size = VOCAB
        self.tokenizer = FakeTokenizer()
        self.chat_template = CHAT_TEMPLATE
        self.free_blocks = self.total_blocks
        self.aborted: list[str] = []
        self.started: list[str] = []
        self._held: dict[str, int] = {}
        self._abort_flags: set[str] = set()
        self.reset()

    def reset(self):
        self.token_delay = 0.002
        self.dead_reason: Optional[str] = None
        self.queue_full = False
        self.die_after: Optional[int] = None
        self.accepting = True

    def check_request(self, prompt_token_ids, params):
        if not prompt_token_ids:
            raise RequestError("prompt", "prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError("prompt", f"prompt has token ids {bad[:5]} outside the vocabulary of {self.vocab_size}")
        total = len(prompt_token_ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise RequestError(
                "max_tokens",
                f"prompt has {len(prompt_token_ids)} tokens + {params.max_new_tokens} "
                f"new tokens = {total}, more than the model's {self.max_model_len} positions",
            )

    def _release(self, request_id: str) -> None:
        self.free_blocks += self._held.pop(request_id, 0)

    def abort(self, request_id: str) -> None:
        if request_id not in self.aborted:
            self.aborted.append(request_id)
        self._abort_flags.add(request_id)
        self._release(request_id)

    def stats(self) -> dict:
        used = self.total_blocks - self.free_blocks
        return {
            "num_requests_running": len(self._held),
            "num_requests_waiting": 0,
            "kv_cache_usage_perc": used / self.total_blocks,
            "num_preemptions_total": 7,
            "free_blocks": self.free_blocks,
            "total_blocks": self.total_blocks,
        }

    def begin_shutdown(self) -> None:
        self.accepting = False

    async def generate(self, request_id, prompt_token_ids, params):
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        if self.queue_full or not self.accepting:
            raise QueueFullError(retry_after_s=2.5)
        self.check_request(prompt_token_ids, params)
        self._held[request_id] = -(-(len(prompt_token_ids) + params.max_new_tokens) // self.block_size)
        self.free_blocks -= self._held[request_id]
        self.started.append(request_id)
        n_prompt = len(prompt_token_ids)
        try:
            for i, token in enumerate(fake_tokens(prompt_token_ids, params.max_new_tokens)):
                await asyncio.sleep(self.token_delay)
                if request_id in self._abort_flags:
                    yield RequestOutput(request_id, [], [], [], "", True, "abort", None, n_prompt, i)
                    return
                if self.die_after is not None and i >= self.die_after:
                    raise EngineDeadError("rank 1 died (fake)")
                lp = -0.25 - 0.1 * (i % 3)
                top = [(token + k, lp - k) for k in range(params.logprobs or 0)]
                reason, stop_reason = None, None
                if token in params.stop_token_ids:
                    reason, stop_reason = "stop", token
                elif i + 1 == params.max_new_tokens:
                    reason = "length"
                yield RequestOutput(
                    request_id,
                    [token],
                    [lp],
                    [top] if params.logprobs else [],
                    self.tokenizer.decode([token]),
                    reason is not None,
                    reason,
                    stop_reason,
                    n_prompt,
                    i + 1,
                )
                if reason is not None:
                    return
        finally:
            self._release(request_id)


def serve_fake_engine_main(ready_file: str, token_delay: float, grace_s: float) -> None:
    """A process serving the fake engine with serve_http (the SIGTERM test runs this as its server):
    writes {"port": ...} to `ready_file` once it listens, prints what shutdown did."""
    engine = FakeEngine()
    engine.token_delay = token_delay

    def ready(host: str, port: int) -> None:
        Path(ready_file).write_text(json.dumps({"port": port}))

    serve_http(
        build_app(engine, MODEL),
        "127.0.0.1",
        0,
        on_ready=ready,
        grace_s=grace_s,
        on_shutdown=lambda: print("on_shutdown called", flush=True),
    )
    print(f"serve_http returned; aborted={engine.aborted}", flush=True)
