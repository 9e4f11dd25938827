"""The HTTP front end's protection (serving/http/guard.py, cli/http_flags.py): API and admin
keys, admin access from loopback only, JSON-only bodies of bounded size, CORS, TLS, hostile JSON,
bounded stop strings, generic 500s, and tokenizing off the event loop.

In-process apps are driven through httpx.ASGITransport (which also lets a test pose as a
non-loopback client without any such traffic); the rest talk to uvicorn on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import ssl
import subprocess
import threading
import time

import httpx
import openai
import psutil
import pytest

from dist_infer.bench.serve import client as bench_serve_client, command as bench_serve
from dist_infer.cli.http_flags import add_http_flags, http_options_of
from dist_infer.serving.http.api_server import DrainingServer, build_app
from dist_infer.serving.http.guard import HttpGuard
from tests.support.fake_engine import MODEL, FakeEngine, fake_tokens

KEYS = ("key-one", "key-two")


class AdminEngine(FakeEngine):
    """The fake engine with the one admin call the routes need to exist."""

    def describe_instances(self):
        return [{"index": 0, "requests": []}]

    def describe_ranks(self):
        return {"running": 1, "max": 2, "origin": "--max-ranks"}


def call(app, method: str, path: str, client=("127.0.0.1", 5000), **kw) -> httpx.Response:
    """One request to `app` in-process, from `client` (an address no packet ever comes from)."""

    async def go():
        transport = httpx.ASGITransport(app=app, client=client, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as h:
            return await h.request(method, path, **kw)

    return asyncio.run(go())


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def serve(app, guard=None):
    """uvicorn on 127.0.0.1 in a thread; returns (port, server, thread)."""
    ready, port = threading.Event(), {}
    server = DrainingServer(
        app, "127.0.0.1", 0, grace_s=1.0, guard=guard, on_ready=lambda host, p: (port.update(p=p), ready.set())
    )
    thread = threading.Thread(target=server.run, name="uvicorn-guard-test", daemon=True)
    thread.start()
    assert ready.wait(30), "the server did not start"
    return port["p"], server, thread


def stop(server, thread):
    server.request_shutdown()
    thread.join(30)


def assert_error(r: httpx.Response, status: int, code=None, needle=None, param="absent") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    if needle is not None:
        assert needle in err["message"], err
    if param != "absent":
        assert err["param"] == param, err
    assert "Traceback" not in err["message"] and "Error:" not in err["message"], err
    return err


# -- keys ----------------------------------------------------------------------------------------------


def test_api_key_guards_v1_and_tokenize_but_not_health():
    app = build_app(FakeEngine(), MODEL, HttpGuard(api_keys=KEYS))
    for path, method, body in (
        ("/v1/models", "GET", None),
        ("/v1/completions", "POST", {"prompt": [1, 2]}),
        ("/tokenize", "POST", {"prompt": "hi"}),
        ("/detokenize", "POST", {"tokens": [65]}),
    ):
        for headers in ({}, bearer("wrong"), {"Authorization": "Basic a2V5LW9uZQ=="}, bearer("key-one2")):
            r = call(app, method, path, json=body, headers=headers)
            err = assert_error(r, 401, "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer" and err["type"] == "invalid_request_error"
            assert "wrong" not in err["message"]
        for key in KEYS:
            assert call(app, method, path, json=body, headers=bearer(key)).status_code == 200, (path, key)
    assert call(app, "GET", "/health").status_code == 200
    assert call(app, "GET", "/metrics").status_code == 200


def test_protect_metrics_needs_the_key_for_health_and_metrics():
    app = build_app(FakeEngine(), MODEL, HttpGuard(api_keys=KEYS, protect_metrics=True))
    for path in ("/health", "/metrics"):
        assert_error(call(app, "GET", path), 401, "invalid_api_key")
        assert call(app, "GET", path, headers=bearer("key-two")).status_code == 200


def test_openai_client_with_api_key_works_unchanged():
    port, server, thread = serve(build_app(FakeEngine(), MODEL, HttpGuard(api_keys=KEYS)))
    try:
        base = f"http://127.0.0.1:{port}/v1"
        good = openai.OpenAI(
            base_url=base, api_key="key-two", max_retries=0, http_client=httpx.Client(trust_env=False, timeout=30)
        )
        r = good.completions.create(model=MODEL, prompt=[1, 5], max_tokens=4, temperature=0)
        assert r.choices[0].token_ids == fake_tokens([1, 5], 4)
        bad = openai.OpenAI(
            base_url=base, api_key="nope", max_retries=0, http_client=httpx.Client(trust_env=False, timeout=30)
        )
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        assert info.value.code == "invalid_api_key"
    finally:
        stop(server, thread)


# -- admin -------------------------------------------------------------------------------------------


def test_admin_answers_loopback_only_without_an_admin_key():
    app = build_app(AdminEngine(), MODEL, HttpGuard(api_keys=KEYS))
    assert call(app, "GET", "/admin/instances").status_code == 200
    assert call(app, "GET", "/admin/instances", client=("::1", 7)).status_code == 200
    for client in (("10.1.2.3", 1234), ("192.168.0.9", 80), ("2001:db8::1", 1)):
        r = call(app, "GET", "/admin/instances", client=client, headers=bearer("key-one"))
        assert_error(r, 403, needle="--admin-key")
        r = call(app, "POST", "/admin/instances/0/drain", client=client)
        assert_error(r, 403, needle="--admin-key")
    for proxied in ({"X-Forwarded-For": "10.1.2.3"}, {"Forwarded": "for=10.1.2.3"}, {"X-Real-IP": "10.1.2.3"}):
        # a reverse proxy on this machine makes every client loopback: its requests are not taken as local
        assert_error(call(app, "GET", "/admin/instances", headers=proxied), 403, needle="--admin-key")


def test_admin_key_opens_admin_to_remote_clients_and_only_it():
    app = build_app(AdminEngine(), MODEL, HttpGuard(api_keys=KEYS, admin_keys=("boss",)))
    remote = ("10.1.2.3", 1234)
    assert call(app, "GET", "/admin/instances", client=remote, headers=bearer("boss")).status_code == 200
    for headers in ({}, bearer("key-one"), bearer("bos")):
        for client in (remote, ("127.0.0.1", 9)):
            assert_error(call(app, "GET", "/admin/instances", client=client, headers=headers), 401, "invalid_api_key")


# -- JSON only, CORS ------------------------------------------------------------------------------------


def test_non_json_posts_get_415():
    app = build_app(FakeEngine(), MODEL)
    body = json.dumps({"prompt": [1, 2], "max_tokens": 2})
    for content_type in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonp",
        None,
    ):
        headers = {}
        if content_type:
            headers["Content-Type"] = content_type
        r = call(app, "POST", "/v1/completions", content=body.encode(), headers=headers)
        if content_type is None:  # httpx sends none for bytes content
            assert "content-type" not in r.request.headers
        assert_error(r, 415, "unsupported_media_type")
        assert "access-control-allow-origin" not in r.headers
    ok = call(
        app,
        "POST",
        "/v1/completions",
        content=body.encode(),
        headers={"Content-Type": "Application/JSON; charset=utf-8"},
    )
    assert ok.status_code == 200, ok.text


def test_a_cross_site_browser_cannot_change_state():
    """A page's form or fetch aimed at the server (the admin routes on loopback included): refused by
    its Origin or Sec-Fetch-Site; a browser's same-origin request must still say JSON; clients that
    are not browsers (no Origin, no Sec-Fetch-Site) are not concerned; reads stay CORS's business."""
    app = build_app(AdminEngine(), MODEL, HttpGuard(allowed_origins=("https://ok.example",)))
    drain = "/admin/instances/0/drain"
    for headers in (
        {"Origin": "https://evil.example"},
        {"Origin": "null"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Origin": "http://testserver:81"},  # another port is another origin
        {"Origin": "https://evil.example", "Content-Type": "application/json"},
    ):
        assert_error(call(app, "POST", drain, headers=headers), 403, "cross_origin_refused")
        assert_error(call(app, "DELETE", "/admin/instances/0", headers=headers), 403, "cross_origin_refused")
    form = {"Origin": "http://testserver", "Content-Type": "application/x-www-form-urlencoded"}
    assert_error(call(app, "POST", drain, headers=form), 415, "unsupported_media_type")
    assert_error(call(app, "POST", drain, headers={"Sec-Fetch-Site": "same-origin"}), 415, "unsupported_media_type")
    for headers in (
        {"Origin": "http://testserver", "Content-Type": "application/json"},
        {},
        {"Origin": "https://ok.example", "Content-Type": "application/json"},
    ):
        assert call(app, "POST", drain, headers=headers).status_code not in (403, 415), headers
    assert call(app, "GET", "/admin/instances", headers={"Origin": "https://evil.example"}).status_code == 200


def test_the_host_header_must_name_the_server():
    """DNS rebinding: a page whose own name resolves to this address sends that name as Host."""
    app = build_app(FakeEngine(), MODEL, HttpGuard(allowed_hosts=("127.0.0.1", "localhost", "::1", "API.example")))
    for host in ("127.0.0.1:8000", "localhost", "[::1]:8000", "api.example:443", "LOCALHOST:1"):
        assert call(app, "GET", "/v1/models", headers={"Host": host}).status_code == 200, host
    for host in ("evil.example", "evil.example:8000", "127.0.0.2", "", "localhost.evil.example"):
        assert_error(call(app, "GET", "/health", headers={"Host": host}), 421, "invalid_host")
    assert call(build_app(FakeEngine(), MODEL, HttpGuard(allowed_hosts=("*",))), "GET", "/health").status_code == 200


def test_allowed_hosts_from_the_flags(tmp_path):
    from dist_infer.cli.http_flags import allowed_hosts_of

    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=api.example",
            "-addext",
            "subjectAltName=DNS:api.example,IP:10.9.8.7",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    add_http_flags(parser)
    assert allowed_hosts_of(parser.parse_args([])) == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts_of(parser.parse_args(["--host", "10.0.0.5", "--allowed-hosts", "a.example,b.example"])) == (
        "a.example",
        "b.example",
        "localhost",
        "127.0.0.1",
        "::1",
        "10.0.0.5",
    )
    assert allowed_hosts_of(parser.parse_args(["--host", "0.0.0.0"])) == ()  # every interface, none given: unchecked
    assert "c.example" in allowed_hosts_of(parser.parse_args(["--host", "::", "--allowed-hosts", "c.example"]))
    assert allowed_hosts_of(parser.parse_args(["--allowed-hosts", "*"])) == ("*",)
    with_tls = allowed_hosts_of(parser.parse_args(["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]))
    assert {"api.example", "10.9.8.7", "127.0.0.1"} <= set(with_tls)
    assert http_options_of(parser.parse_args([]), {}).allowed_hosts == ("localhost", "127.0.0.1", "::1")


def test_cors_only_for_allowed_origins():
    app = build_app(FakeEngine(), MODEL, HttpGuard(api_keys=KEYS, allowed_origins=("https://ok.example",)))
    pre = call(
        app,
        "OPTIONS",
        "/v1/completions",
        headers={
            "Origin": "https://ok.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://ok.example"
    r = call(app, "GET", "/v1/models", headers={"Origin": "https://ok.example", **bearer("key-one")})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ok.example"
    r = call(app, "GET", "/v1/models", headers={"Origin": "https://evil.example", **bearer("key-one")})
    assert "access-control-allow-origin" not in r.headers
    plain = build_app(FakeEngine(), MODEL)
    r = call(plain, "GET", "/v1/models", headers={"Origin": "https://ok.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_openapi_describes_every_post_body():
    schema = call(build_app(AdminEngine(), MODEL), "GET", "/openapi.json").json()
    posts = {path: ops["post"] for path, ops in schema["paths"].items() if "post" in ops}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/admin/migrate"} <= set(posts)
    for path, op in posts.items():
        if "{index}" in path:
            continue  # drain/stop/restart take no body
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body["type"] == "object" and body["properties"], path
        assert "$defs" not in json.dumps(body), path
    assert (
        "max_tokens" in posts["/v1/completions"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    )


# -- bounded bodies -------------------------------------------------------------------------------------


def asgi_post(app, headers: list, chunks):
    """POST straight into the ASGI app; returns (status, body, how many chunks it read)."""
    reads, sent = [0], []
    it = iter(chunks)

    async def receive():
        reads[0] += 1
        chunk = next(it, None)
        return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body), reads[0]


def test_content_length_over_the_limit_is_413_unread():
    app = build_app(FakeEngine(), MODEL)
    fifty_mb = 50 * 1024 * 1024
    status, body, reads = asgi_post(
        app, [(b"content-length", str(fifty_mb).encode())], (b" " * 65536 for _ in range(800))
    )
    assert status == 413 and body["error"]["code"] == "request_too_large" and reads == 0


def test_chunked_body_stops_being_read_past_the_limit():
    app = build_app(FakeEngine(), MODEL, HttpGuard(max_body_bytes=1024 * 1024))
    status, body, reads = asgi_post(app, [(b"transfer-encoding", b"chunked")], (b" " * 65536 for _ in range(800)))
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert reads == 17  # 16 chunks of 64 KiB are the limit; the 17th passes it and nothing more is read


def _http_exchange(port: int, head: bytes, chunk: bytes, max_bytes: int) -> tuple[bytes, int]:
    """Send `head`, then `chunk` repeatedly until the server answers or max_bytes went; (answer, bytes sent)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        sock.setblocking(False)
        answer = b""
        while sent < max_bytes and not answer:
            try:
                answer = sock.recv(65536)
                break
            except BlockingIOError:
                pass
            try:
                sent += sock.send(chunk)
            except BlockingIOError:
                time.sleep(0.001)
            except OSError:  # the server closed the connection after answering
                break
        sock.settimeout(30)
        sock.setblocking(True)
        try:
            answer += sock.recv(65536)
        except OSError:
            pass
    return answer, sent


def test_fifty_megabytes_over_real_http_are_refused_without_being_kept():
    fifty_mb = 50 * 1024 * 1024
    app = build_app(FakeEngine(), MODEL, HttpGuard(max_body_bytes=1024 * 1024))
    port, server, thread = serve(app)
    rss_before = psutil.Process().memory_info().rss
    try:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {fifty_mb}\r\n\r\n"
        ).encode()
        answer, sent = _http_exchange(port, head, b" " * 65536, fifty_mb)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert sent < fifty_mb
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"10000\r\n" + b" " * 65536 + b"\r\n"
        answer, sent = _http_exchange(port, head, chunk, fifty_mb)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert sent < fifty_mb / 2  # it stopped reading: only socket buffers' worth went past the limit
        grown = psutil.Process().memory_info().rss - rss_before
        assert grown < 40 * 1024 * 1024, f"RSS grew {grown / 2**20:.0f} MiB"
        with httpx.Client(trust_env=False, timeout=30) as h:
            assert h.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        stop(server, thread)


# -- hostile JSON, stop strings, generic 500s -------------------------------------------------------------

HOSTILE = [
    ("[" * 100_000, None, "nests"),
    ('{"prompt": ' + "[" * 100 + "]" * 100 + "}", "prompt", "nests"),
    ('{"prompt": [1, 2], "max_tokens": ' + "7" * 5000 + "}", None, "digits"),
    ('{"prompt": [1, 2], "seed": ' + "9" * 400 + "}", "seed", None),
    ('{"prompt": "\\ud800 hi"}', "prompt", "surrogate"),
    ('{"prompt": "hi", "stop": ["\\udfff"]}', "stop", "surrogate"),
    ('{"prompt": [1, 2], "temperature": 1e400}', "temperature", "double"),
    ('{"prompt": [1, 2], "temperature": NaN}', None, "NaN"),
    ('{"prompt": [1, 2], "top_p": -Infinity}', None, "Infinity"),
    (b'{"prompt": "\xff\xfe"}', None, "UTF-8"),
    ('{"prompt": [1, 2], "max_tokens": "' + "1" * 5000 + '"}', "max_tokens", None),
]


@pytest.mark.parametrize("body,param,needle", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_json_is_a_400_without_internals(body, param, needle):
    app = build_app(FakeEngine(), MODEL)
    raw = body if isinstance(body, bytes) else body.encode()
    for path in ("/v1/completions", "/tokenize"):
        r = call(app, "POST", path, content=raw, headers={"content-type": "application/json"})
        err = assert_error(r, 400, needle=needle)
        if path == "/v1/completions":
            assert err["param"] == param, err
        for leak in ("RecursionError", "ValueError", "UnicodeEncodeError", 'File "', "line "):
            assert leak not in err["message"] or "line 1 column" in err["message"], err


def test_stop_strings_are_bounded():
    app = build_app(FakeEngine(), MODEL)
    for stop in (["x"] * 10_000, ["s%d" % i for i in range(17)], ["y" * 513]):
        r = call(app, "POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 3, "stop": stop})
        assert_error(r, 400, param="stop", needle="16")
    ok = call(app, "POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 3, "stop": ["z" * 512] * 16})
    assert ok.status_code == 200, ok.text


def test_unexpected_exception_is_a_generic_500_with_an_id():
    engine = FakeEngine()

    def broken(prompt_token_ids, params):
        raise RuntimeError("secret internals /etc/passwd")

    engine.check_request = broken
    r = call(build_app(engine, MODEL), "POST", "/v1/completions", json={"prompt": [1, 2]})
    err = assert_error(r, 500)
    assert err["message"].startswith("internal error (id err-") and "server log" in err["message"], err
    assert "secret" not in r.text and "RuntimeError" not in r.text


# -- tokenizing off the event loop -------------------------------------------------------------------------


class GatedTokenizer:
    """Wraps a tokenizer: a long encode waits on a gate the test opens (at most 60 s)."""

    def __init__(self, inner):
        self.inner = inner
        self.bos_id, self.eos_id = inner.bos_id, inner.eos_id
        self.entered = threading.Event()
        self.gate = threading.Event()

    def encode(self, text, add_bos=True):
        if len(text) > 100_000:
            self.entered.set()
            self.gate.wait(60)
        return self.inner.encode(text, add_bos)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_health_answers_while_a_large_prompt_is_tokenized():
    engine = FakeEngine()
    engine.tokenizer = GatedTokenizer(engine.tokenizer)
    port, server, thread = serve(build_app(engine, MODEL))
    url = f"http://127.0.0.1:{port}"
    result = {}

    def tokenize():
        with httpx.Client(trust_env=False, timeout=120) as h:
            result["r"] = h.post(url + "/tokenize", json={"prompt": "a" * 1_000_000})

    worker = threading.Thread(target=tokenize)
    worker.start()
    try:
        assert engine.tokenizer.entered.wait(60), "the tokenize request never reached the tokenizer"
        with httpx.Client(trust_env=False, timeout=20) as h:
            health = h.get(url + "/health")
        assert health.status_code == 200
        assert not engine.tokenizer.gate.is_set() and worker.is_alive()  # answered before the tokenize finished
    finally:
        engine.tokenizer.gate.set()
        worker.join(60)
        stop(server, thread)
    assert result["r"].status_code == 200 and result["r"].json()["count"] == 1_000_001


# -- TLS and the flags -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("tls")
    key, cert = d / "key.pem", d / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(key), str(cert)


def test_tls_serves_https_and_bench_serve_speaks_it(self_signed, capsys):
    key, cert = self_signed
    guard = HttpGuard(api_keys=("k",), ssl_keyfile=key, ssl_certfile=cert)
    port, server, thread = serve(build_app(FakeEngine(), MODEL, guard))
    url = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(trust_env=False, timeout=30, verify=ssl.create_default_context(cafile=cert)) as h:
            assert h.get(url + "/v1/models", headers=bearer("k")).json()["data"][0]["id"] == MODEL
        with httpx.Client(trust_env=False, timeout=30) as h, pytest.raises(httpx.ConnectError):
            h.get(url + "/health")  # the system's CAs do not know a self-signed certificate
        common = [
            "--url",
            url,
            "--num-prompts",
            "2",
            "--prompt-ids",
            "--input-len",
            "4",
            "--output-len",
            "3",
            "--json",
            "--max-concurrency",
            "2",
        ]
        assert bench_serve.main(common + ["--ca-cert", cert, "--api-key", "k"]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completed"] == 2
        assert bench_serve.main(common + ["--insecure", "--api-key", "k"]) == 0
        assert bench_serve.main(common + ["--insecure", "--api-key", "wrong", "--model", MODEL]) == 1  # 401s
    finally:
        stop(server, thread)


def test_bench_serve_api_key_from_the_environment():
    assert bench_serve_client.api_key_of(None, {"OPENAI_API_KEY": "a", "DIST_INFER_API_KEY": "b"}) == "a"
    assert bench_serve_client.api_key_of(None, {"DIST_INFER_API_KEY": "b"}) == "b"
    assert bench_serve_client.api_key_of("c", {"OPENAI_API_KEY": "a"}) == "c"
    assert bench_serve_client.api_key_of(None, {}) is None


def test_http_flags_make_the_guard(self_signed):
    key, cert = self_signed
    parser = argparse.ArgumentParser()
    add_http_flags(parser)
    for action in parser._actions:
        assert action.help, action.dest
    args = parser.parse_args(
        [
            "--api-key",
            "a",
            "--api-key",
            "b",
            "--admin-key",
            "z",
            "--allowed-origins",
            "https://x.example,https://y.example",
            "--allowed-origins",
            "*",
            "--max-body-bytes",
            "2M",
            "--protect-metrics",
            "--ssl-keyfile",
            key,
            "--ssl-certfile",
            cert,
            "--ssl-cert-reqs",
            "1",
        ]
    )
    guard = http_options_of(args, {"DIST_INFER_API_KEY": "c, d,,a"})
    assert guard == HttpGuard(
        api_keys=("a", "b", "c", "d"),
        admin_keys=("z",),
        protect_metrics=True,
        allowed_origins=("https://x.example", "https://y.example", "*"),
        max_body_bytes=2 * 1024 * 1024,
        ssl_keyfile=key,
        ssl_certfile=cert,
        ssl_cert_reqs=1,
    )
    assert http_options_of(parser.parse_args([]), {}) == HttpGuard()
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-body-bytes", "lots"])
    with pytest.raises(ValueError):
        http_options_of(parser.parse_args(["--ssl-certfile", cert]), {})
