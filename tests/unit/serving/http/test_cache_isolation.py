"""The prefix cache as a side channel, closed (serving/http/cache_isolation.py, --prefix-cache-isolation):
the salts the front end gives requests (per API key under `key`, the request's own cache_salt mixed
in), the flag and its default, and through real HTTP on 127.0.0.1 in front of a fake engine that
caches prefixes by the engine's own salted block hashes: with two keys and isolation `key` the
second key's identical prompt gets no prefix hit, its own key's does; /metrics leaves the hit
counters out when keys are on and it is open."""

from __future__ import annotations

import argparse
import threading

import httpx
import pytest

from dist_infer.cli.http_flags import add_http_flags, http_options_of
from dist_infer.serving.fleet.prefix_index import prompt_block_hashes
from dist_infer.serving.http.api_server import DrainingServer, build_app
from dist_infer.serving.http.cache_isolation import CacheIsolation, isolation_mode
from dist_infer.serving.http.guard import HttpGuard
from tests.support.fake_engine import MODEL, FakeEngine

KEYS = ("key-alice", "key-bob")
PROMPT = list(range(40, 40 + 33))  # 8 full blocks of 4 before the last token


# -- the salts -------------------------------------------------------------------------------------------


def test_none_passes_the_requests_own_salt_through():
    iso = CacheIsolation("none")
    assert iso.cache_salt("key-alice", None) is None and iso.cache_salt("key-bob", "s") == "s"


def test_key_salts_by_key_and_mixes_the_requests_salt_in():
    iso = CacheIsolation("key")
    alice, bob = iso.cache_salt(KEYS[0], None), iso.cache_salt(KEYS[1], None)
    assert alice == iso.cache_salt(KEYS[0], None) and alice != bob, "one salt per key, stable within the job"
    salted = {iso.cache_salt(k, s) for k in KEYS for s in ("s", "t")}
    assert len(salted) == 4 and not salted & {alice, bob}, "a request salt never lands on another key's salt"
    assert iso.cache_salt(KEYS[1], alice) not in (alice, bob), "not even one that is another key's salt"
    assert all(KEYS[0] not in x for x in salted | {alice}), "the key itself never travels"
    assert CacheIsolation("key").cache_salt(KEYS[0], None) != alice, "a new serve job draws a new secret"
    assert all(len(x) <= 256 for x in salted | {alice}), "within what SamplingParams takes"
    assert repr(iso.secret) not in repr(iso), "the secret stays out of logs"


def test_the_mode_defaults_to_key_with_keys_and_refuses_key_without():
    assert isolation_mode(None, True) == "key" and isolation_mode(None, False) == "none"
    assert isolation_mode("none", True) == "none"
    with pytest.raises(ValueError, match="--api-key"):
        isolation_mode("key", False)
    with pytest.raises(ValueError, match="prefix-cache-isolation"):
        isolation_mode("tenant", True)
    p = argparse.ArgumentParser()
    add_http_flags(p)
    assert http_options_of(p.parse_args(["--api-key", "a"]), {}).prefix_cache_isolation == "key"
    assert http_options_of(p.parse_args([]), {}).prefix_cache_isolation == "none"
    args = p.parse_args(["--api-key", "a", "--prefix-cache-isolation", "none"])
    assert http_options_of(args, {}).prefix_cache_isolation == "none"
    with pytest.raises(ValueError, match="needs API keys"):
        http_options_of(p.parse_args(["--prefix-cache-isolation", "key"]), {})
    with pytest.raises(SystemExit):
        p.parse_args(["--prefix-cache-isolation", "tenant"])


# -- through HTTP ----------------------------------------------------------------------------------------


class CachingEngine(FakeEngine):
    """The fake engine with a prefix cache named as the engine names it (salted block hashes): each
    prompt counts the leading blocks found as hit tokens, then its blocks are cached."""

    def __init__(self):
        super().__init__()
        self.cached: set[int] = set()
        self.hits, self.queries, self.salts = 0, 0, []

    async def generate(self, request_id, prompt_token_ids, params):
        hashes = prompt_block_hashes(prompt_token_ids, self.block_size, params.cache_salt)
        found = next((i for i, h in enumerate(hashes) if h not in self.cached), len(hashes))
        self.hits += found * self.block_size
        self.queries += len(prompt_token_ids)
        self.cached.update(hashes)
        self.salts.append(params.cache_salt)
        async for out in super().generate(request_id, prompt_token_ids, params):
            yield out

    def stats(self) -> dict:
        return dict(super().stats(), prefix_cache_hits=self.hits, prefix_cache_queries=self.queries)


def serve(guard: HttpGuard):
    engine = CachingEngine()
    ready, port = threading.Event(), {}
    server = DrainingServer(
        build_app(engine, MODEL, guard),
        "127.0.0.1",
        0,
        grace_s=1.0,
        guard=guard,
        on_ready=lambda host, p: (port.update(p=p), ready.set()),
    )
    thread = threading.Thread(target=server.run, name="uvicorn-isolation-test", daemon=True)
    thread.start()
    assert ready.wait(30), "the server did not start"
    return engine, f"http://127.0.0.1:{port['p']}", (server, thread)


@pytest.fixture
def served(request):
    engine, url, (server, thread) = serve(request.param)
    yield engine, url
    server.request_shutdown()
    thread.join(30)


def hit_tokens(engine: CachingEngine, url: str, key: str, endpoint: str = "completions", **body) -> int:
    """The prefix hit of one request of PROMPT with `key` (and `body`'s extra fields)."""
    before = engine.hits
    payload = {"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": "x" * 40}]}
    with httpx.Client(trust_env=False, timeout=30) as h:
        r = h.post(
            f"{url}/v1/{endpoint}",
            json={**payload, "max_tokens": 2, **body},
            headers={"Authorization": f"Bearer {key}"},
        )
    assert r.status_code == 200, r.text
    return engine.hits - before


@pytest.mark.parametrize("served", [HttpGuard(api_keys=KEYS)], indirect=True)
def test_with_isolation_key_another_keys_identical_prompt_gets_no_prefix_hit(served):
    engine, url = served
    alice, bob = KEYS
    assert [hit_tokens(engine, url, k) for k in (alice, bob, alice, bob)] == [0, 0, 32, 32]
    assert hit_tokens(engine, url, bob, cache_salt="shared") == 0, "a salt starts a group of its own"
    assert hit_tokens(engine, url, alice, cache_salt="shared") == 0, "the same salt under another key shares nothing"
    assert hit_tokens(engine, url, alice, cache_salt="shared") == 32
    chat = [hit_tokens(engine, url, k, "chat/completions") for k in (alice, bob, alice)]
    assert chat[:2] == [0, 0] and chat[2] >= 40, ("chat is salted by key too", chat)
    assert all(s and s.startswith(("key:", "key+salt:")) and not any(k in s for k in KEYS) for s in engine.salts)


@pytest.mark.parametrize("served", [HttpGuard(api_keys=KEYS, prefix_cache_isolation="none")], indirect=True)
def test_with_isolation_none_keys_share_unless_their_salts_differ(served):
    engine, url = served
    alice, bob = KEYS
    assert [hit_tokens(engine, url, k) for k in (alice, bob)] == [0, 32], "one cache for everyone"
    assert hit_tokens(engine, url, bob, cache_salt="bob's") == 0
    assert hit_tokens(engine, url, alice, cache_salt="bob's") == 32, "whoever knows the salt shares"


# -- /metrics ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "guard,shown",
    [
        (HttpGuard(), True),
        (HttpGuard(api_keys=KEYS), False),
        (HttpGuard(api_keys=KEYS, prefix_cache_isolation="none"), False),
        (HttpGuard(api_keys=KEYS, protect_metrics=True), True),
    ],
    ids=["no-keys", "keys-open-metrics", "keys-isolation-none", "protected-metrics"],
)
def test_metrics_show_the_hit_counters_only_where_no_key_can_read_another_keys(guard, shown):
    _, url, (server, thread) = serve(guard)
    try:
        with httpx.Client(trust_env=False, timeout=30) as h:
            text = h.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).text
    finally:
        server.request_shutdown()
        thread.join(30)
    assert "dist_infer:num_requests_running" in text, "the other series stay"
    for name in ("prefix_cache_hits", "prefix_cache_queries"):
        assert (f"dist_infer:{name}_total" in text) is shown, (name, shown)
