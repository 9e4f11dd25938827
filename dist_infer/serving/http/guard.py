"""What stands between the network and the API's routes: API keys, admin access, request bodies
of bounded size and of JSON only, CORS, browsers kept from changing state cross-site (Origin,
Sec-Fetch-Site, the Host header against DNS rebinding), and the errors all of them answer in
OpenAI's shape.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware) so that it can refuse a body by its
Content-Length before a byte of it is read, and stop reading a chunked body as soon as it passes
the limit: a client must not be able to make the server buffer more than `max_body_bytes`.
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

from loguru import logger

from dist_infer.serving.http.cache_isolation import isolation_mode

if TYPE_CHECKING:  # starlette (the serve extra) is imported where a response is made: the CLI's flags need none
    from starlette.responses import JSONResponse

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 1024  # open at once; more are answered 503 (serving/http/connections.py)
DEFAULT_HEADER_TIMEOUT_S = 30.0  # a request's whole head must arrive within this
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0  # an idle connection is closed after this (uvicorn's default)
ERROR_TYPES = {
    400: "BadRequestError",
    401: "invalid_request_error",
    403: "PermissionDeniedError",
    421: "MisdirectedRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
BODY_METHODS = ("POST", "PUT", "PATCH")
STATE_METHODS = BODY_METHODS + ("DELETE",)  # what a cross-site browser request may not do
OPEN_PATHS = ("/health", "/metrics")  # open (as in vLLM) unless protect_metrics


# -- errors ---------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error response: status, message, the offending field (`param`), extra headers, and
    optionally OpenAI's `code` string (default: the status)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
        code: Optional[str] = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.code = code


def error_body(status: int, message: str, param: Optional[str] = None, code: Any = None) -> dict:
    """OpenAI's error shape."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "APIError"),
            "param": param,
            "code": status if code is None else code,
        }
    }


def error_response(err: ApiError) -> JSONResponse:
    from starlette.responses import JSONResponse

    return JSONResponse(
        error_body(err.status, err.message, err.param, err.code), status_code=err.status, headers=err.headers
    )


def internal_error(exc: BaseException, where: str = "request") -> ApiError:
    """A 500 that tells the client only an id to quote; the exception itself goes to the log."""
    error_id = f"err-{uuid.uuid4().hex[:12]}"
    logger.opt(exception=exc).error(f"{where} failed with an unexpected error (id {error_id}): {exc!r}")
    return ApiError(500, f"internal error (id {error_id}); see the server log")


# -- the settings -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HttpGuard:
    """How the HTTP front end protects itself (cli/http_flags.py makes one from the flags).

    api_keys: any of them as `Authorization: Bearer KEY` opens /v1/*, /tokenize, /detokenize (none: open).
    admin_keys: any of them opens /admin/* (none: /admin/* answers loopback clients only).
    protect_metrics: /health and /metrics need an api key too.
    prefix_cache_isolation: whose requests share the prefix cache, `none` or `key` (serving/http/cache_isolation.py);
      None: `key` with api keys, else `none`.
    allowed_origins: CORS origins ("*" for any); none: no CORS headers at all. They are also the
      only other origins from which a browser may change state (POST, PUT, PATCH, DELETE).
    allowed_hosts: the names the Host header may carry (lower case, no port; "*" any); none: not
      checked (the library's default; `dist-infer serve` gives its bound address and loopback names).
    max_connections, header_timeout_s, keep_alive_timeout_s: the connections' bounds
    (serving/http/connections.py).
    ssl_*: uvicorn's TLS settings (ssl_cert_reqs: 0 none, 1 optional, 2 required client certificates)."""

    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()
    protect_metrics: bool = False
    prefix_cache_isolation: Optional[str] = None
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    ssl_keyfile: Optional[str] = None
    ssl_certfile: Optional[str] = None
    ssl_ca_certs: Optional[str] = None
    ssl_cert_reqs: int = 0

    @property
    def cache_isolation_mode(self) -> str:
        """prefix_cache_isolation as __post_init__ settled it: `none` or `key`, the default resolved."""
        return isolation_mode(self.prefix_cache_isolation, bool(self.api_keys))

    def __post_init__(self):
        for name in ("api_keys", "admin_keys", "allowed_origins"):
            object.__setattr__(self, name, tuple(v for v in getattr(self, name) if v))
        object.__setattr__(
            self, "allowed_hosts", tuple(h.strip().lower().strip("[]") for h in self.allowed_hosts if h.strip())
        )
        object.__setattr__(
            self, "prefix_cache_isolation", isolation_mode(self.prefix_cache_isolation, bool(self.api_keys))
        )
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        for name in ("header_timeout_s", "keep_alive_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:  # (nan fails too)
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"ssl_cert_reqs must be 0, 1 or 2, got {self.ssl_cert_reqs}")
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ValueError("TLS needs both a key file and a certificate file")

    @property
    def open_prefix_cache_metrics(self) -> bool:
        """Whether /metrics may show the prefix cache's hit counters: only where it is no side channel
        between keys (no keys, so no one to keep apart) or it needs a key itself (--protect-metrics)."""
        return not self.api_keys or self.protect_metrics

    @property
    def tls(self) -> bool:
        return bool(self.ssl_certfile)

    def uvicorn_ssl(self) -> dict[str, Any]:
        """uvicorn.Config's TLS keyword arguments (empty without TLS)."""
        if not self.tls:
            return {}
        return {
            "ssl_keyfile": self.ssl_keyfile,
            "ssl_certfile": self.ssl_certfile,
            "ssl_ca_certs": self.ssl_ca_certs,
            "ssl_cert_reqs": self.ssl_cert_reqs,
        }


def key_matches(token: Optional[str], keys: tuple[str, ...]) -> bool:
    """Whether `token` is one of `keys`, comparing with every key in constant time."""
    if token is None:
        return False
    given = token.encode("utf-8", "surrogateescape")
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key.encode("utf-8", "surrogateescape"))
    return found


def bearer_token(headers: Mapping[str, str]) -> Optional[str]:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


PROXIED = {"forwarded", "x-forwarded-for", "x-forwarded-host", "x-real-ip"}  # headers a reverse proxy adds


def is_loopback(client) -> bool:
    """A client on this machine (no client: a unix socket, which is local too)."""
    if not client:
        return True
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


# -- the middleware ---------------------------------------------------------------------------------


class BodyTooLarge(ApiError):
    def __init__(self, limit: int):
        super().__init__(
            413,
            f"the request body is larger than the server's limit of {limit} bytes",
            None,
            {"Connection": "close"},
            "request_too_large",
        )


class GuardMiddleware:
    """Refuses, before the app sees them: requests without a valid key, admin requests it may not
    take, bodies over the limit (by header, or while read) and bodies that are not JSON."""

    def __init__(self, app, guard: HttpGuard):
        self.app = app
        self.guard = guard

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        refusal = self.refusal(scope, headers)
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        await self.call_limited(scope, receive, send)

    def refusal(self, scope, headers: dict[str, str]) -> Optional[ApiError]:
        """Why this request is refused before its body is read; None if it is not."""
        refusal = (
            host_refusal(headers, self.guard.allowed_hosts)
            or browser_refusal(scope["method"], headers, self.guard.allowed_origins)
            or self.access_refusal(scope["path"], scope.get("client"), headers)
        )
        if refusal is not None or scope["method"] not in BODY_METHODS:
            return refusal
        length = headers.get("content-length")
        if length is not None:
            if not (length.strip().isascii() and length.strip().isdigit()) or len(length.strip()) > 19:
                return ApiError(400, f"Content-Length {length[:40]!r} is not a byte count")
            if int(length) > self.guard.max_body_bytes:
                return BodyTooLarge(self.guard.max_body_bytes)
        # a browser's request must say JSON even without a body: a form's cannot, and a page's fetch
        # that says so is preflighted by CORS (clients that are not browsers may post nothing, plainly)
        from_browser = "origin" in headers or "sec-fetch-site" in headers
        has_body = "transfer-encoding" in headers or (length is not None and int(length) > 0) or from_browser
        media_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if has_body and media_type != "application/json":
            shown = headers.get("content-type") or "none"
            return ApiError(
                415,
                f"the request body must be JSON (Content-Type: application/json), got Content-Type {shown[:80]!r}",
                None,
                None,
                "unsupported_media_type",
            )
        return None

    def access_refusal(self, path: str, client, headers: dict[str, str]) -> Optional[ApiError]:
        guard = self.guard
        if path == "/admin" or path.startswith("/admin/"):
            if guard.admin_keys:
                return None if key_matches(bearer_token(headers), guard.admin_keys) else _invalid_key("an admin")
            if is_loopback(client) and not PROXIED.intersection(headers):
                return None  # (a proxy on this machine makes every client look local: not trusted so)
            return ApiError(
                403,
                "the admin routes answer clients on this machine only; start the server with "
                "--admin-key to allow others (Authorization: Bearer <admin key>)",
                None,
                None,
                "admin_loopback_only",
            )
        needs_key = (
            path == "/v1"
            or path.startswith("/v1/")
            or path in ("/tokenize", "/detokenize")
            or (guard.protect_metrics and path in OPEN_PATHS)
        )
        if needs_key and guard.api_keys and not key_matches(bearer_token(headers), guard.api_keys):
            return _invalid_key("an API")
        return None

    async def call_limited(self, scope, receive, send) -> None:
        """The app, with a receive that raises BodyTooLarge once the body passes the limit."""
        limit = self.guard.max_body_bytes
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge as exc:
            if started:
                raise
            await error_response(exc)(scope, receive, send)


def host_name(host_header: str) -> str:
    """The name in a Host header, lower case, without its port ("[::1]:8000" -> "::1")."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_refusal(headers: dict[str, str], allowed_hosts: tuple[str, ...]) -> Optional[ApiError]:
    """A Host header that names none of the server's names: a DNS-rebound page's request (its own
    name resolved to this address) or a misdirected one. None where allowed or not checked."""
    if not allowed_hosts or "*" in allowed_hosts:
        return None
    name = host_name(headers.get("host", ""))
    if name in allowed_hosts:
        return None
    return ApiError(
        421,
        f"the Host header {headers.get('host', '')[:80]!r} is not one of this server's names "
        f"({', '.join(allowed_hosts)}); start it with --allowed-hosts to add one",
        None,
        None,
        "invalid_host",
    )


def same_origin(origin: str, host_header: str) -> bool:
    """Whether a browser's Origin ("http://host:port") is the server's own (its Host header)."""
    _, sep, rest = origin.partition("://")
    return bool(sep) and rest.rstrip("/").lower() == host_header.strip().lower()


def browser_refusal(method: str, headers: dict[str, str], allowed_origins: tuple[str, ...]) -> Optional[ApiError]:
    """A browser asked to change state from another site: a page's form or fetch aimed at this
    server (its admin routes on loopback included). Browsers send Origin and Sec-Fetch-Site on such
    requests; clients that are not browsers send neither and are not concerned."""
    if method not in STATE_METHODS:
        return None
    origin = headers.get("origin")
    if origin is not None and ("*" in allowed_origins or origin in allowed_origins):
        return None
    cross = headers.get("sec-fetch-site", "").strip().lower() == "cross-site"
    if (origin is None and not cross) or (
        origin is not None and not cross and same_origin(origin, headers.get("host", ""))
    ):
        return None
    shown = origin if origin is not None else "a cross-site page"
    return ApiError(
        403,
        f"a browser request from {shown[:80]!r} may not change this server's state; allow "
        f"its origin with --allowed-origins",
        None,
        None,
        "cross_origin_refused",
    )


def _invalid_key(which: str) -> ApiError:
    return ApiError(
        401,
        f"missing or invalid API key: send {which} key as 'Authorization: Bearer <key>'",
        None,
        {"WWW-Authenticate": "Bearer"},
        "invalid_api_key",
    )


def install_guard(app, guard: HttpGuard) -> None:
    """Put the guard in front of `app`, and CORS (only with allowed origins) in front of both, so
    that a browser's preflight OPTIONS gets its answer without a key."""
    app.state.http_guard = guard
    app.add_middleware(GuardMiddleware, guard=guard)
    if guard.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(guard.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            allow_credentials="*" not in guard.allowed_origins,
        )
