"""The command-line flags of the HTTP front end's protection (keys, TLS, CORS, body limit, connection bounds),
turned into the HttpGuard that serving/http/api_server.py's build_app and serve_http take."""

from __future__ import annotations

import argparse
import os
from typing import Iterable, Mapping, Optional

from dist_infer.arg_types import existing_file, positive_int, positive_seconds, positive_size
from dist_infer.serving.http.cache_isolation import ISOLATION_MODES
from dist_infer.serving.http.guard import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    HttpGuard,
)

API_KEY_ENV = "DIST_INFER_API_KEY"  # comma-separated keys, added to --api-key


def add_http_flags(p: argparse.ArgumentParser) -> None:
    """The HTTP front end's protection flags (for `dist-infer serve`), one help section."""
    g = p.add_argument_group("HTTP security")
    _add_key_flags(g)
    _add_origin_flags(g)
    _add_bound_flags(g)
    _add_tls_flags(g)


def _add_key_flags(g: argparse._ArgumentGroup) -> None:
    """Who may call what: the API and admin keys, the open probes, whose cached prefixes are shared."""
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (repeat for "
        f"several keys; ${API_KEY_ENV} adds comma-separated ones). Default: no key needed",
    )
    g.add_argument(
        "--admin-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /admin/* (repeatable). Without one, /admin/* "
        "answers clients on this machine (loopback) only; behind a local reverse proxy every "
        "client looks local, so set one there",
    )
    g.add_argument(
        "--protect-metrics",
        action="store_true",
        help="/health and /metrics need an --api-key too (default: open, as in vLLM, for probes and Prometheus)",
    )
    g.add_argument(
        "--prefix-cache-isolation",
        choices=ISOLATION_MODES,
        default=None,
        help="whose requests may share cached prompt prefixes. A cached prefix answers much sooner, so "
        "sharing lets one client time whether another sent a prompt. key: each --api-key's requests "
        "share only with the same key's (the key's HMAC, under a secret drawn per serve job, salts "
        "them); none: all requests share, unless they send different cache_salt values. Default: "
        "key when --api-key is set, else none",
    )


def _add_origin_flags(g: argparse._ArgumentGroup) -> None:
    """Which browsers' pages may read the answers (CORS) and which Host names are served."""
    g.add_argument(
        "--allowed-origins",
        action="append",
        default=[],
        metavar="ORIGIN[,ORIGIN...]",
        help="enable CORS for these browser origins (comma list or repeat; * for any). Default: no "
        "CORS headers, so browsers refuse cross-origin reads",
    )
    g.add_argument(
        "--allowed-hosts",
        action="append",
        default=[],
        metavar="HOST[,HOST...]",
        help="names a request's Host header may carry (comma list or repeat; * for any), besides the "
        "ones always allowed: the --host address, localhost, 127.0.0.1, ::1 and the TLS "
        "certificate's names. Any other gets 421, so a page whose own name was made to resolve "
        "to this server (DNS rebinding) cannot reach it. Bound to every interface (0.0.0.0, ::), "
        "only these names and the loopback ones are allowed; give none there and the Host header "
        "is not checked",
    )


def _add_bound_flags(g: argparse._ArgumentGroup) -> None:
    """How much one client may hold: the body size, the open connections, how long a head or an idle
    connection may take."""
    g.add_argument(
        "--max-body-bytes",
        type=positive_size,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="SIZE",
        help="largest request body accepted (e.g. 1048576, 512K, 16M); larger ones get 413 without "
        "being read (default 16M)",
    )
    g.add_argument(
        "--max-connections",
        type=positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="HTTP connections open at once; a connection past N is answered 503 and closed at once, "
        "and running requests are bounded likewise (default %(default)s)",
    )
    g.add_argument(
        "--header-timeout",
        type=positive_seconds,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="a client must send a request's whole head (request line and headers) within this many "
        "seconds of connecting, or of the previous response's end, or its connection is closed: "
        "slow clients cannot hold connections (default %(default)g)",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=positive_seconds,
        default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        metavar="SECONDS",
        help="an idle keep-alive connection is closed when no new request starts "
        "within this many seconds (default %(default)g, uvicorn's)",
    )


def _add_tls_flags(g: argparse._ArgumentGroup) -> None:
    """HTTPS: the server's key and certificate, and the client certificates it asks for."""
    g.add_argument(
        "--ssl-keyfile",
        type=existing_file,
        default=None,
        metavar="FILE",
        help="serve HTTPS with this PEM private key (needs --ssl-certfile)",
    )
    g.add_argument(
        "--ssl-certfile",
        type=existing_file,
        default=None,
        metavar="FILE",
        help="serve HTTPS with this PEM certificate chain (needs --ssl-keyfile)",
    )
    g.add_argument(
        "--ssl-ca-certs",
        type=existing_file,
        default=None,
        metavar="FILE",
        help="CA certificates (PEM) that client certificates are checked against (with --ssl-cert-reqs)",
    )
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=(0, 1, 2),
        default=0,
        help="client certificates: 0 not asked for, 1 checked if sent, 2 required (as uvicorn; default %(default)s)",
    )


def _split(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(item.strip() for value in values for item in value.split(",") if item.strip())


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


def certificate_names(certfile: Optional[str]) -> tuple[str, ...]:
    """The DNS names and addresses a PEM certificate is for (its subjectAltName); none if unreadable."""
    if not certfile:
        return ()
    import ssl

    try:
        # CPython's own reader (no third-party parser needed); private, so typeshed does not list it
        decoded = ssl._ssl._test_decode_cert(certfile)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a certificate uvicorn will refuse anyway: no names from it
        return ()
    return tuple(value for kind, value in decoded.get("subjectAltName", ()) if kind in ("DNS", "IP Address"))


def allowed_hosts_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The Host header's allowed names: --allowed-hosts, the bound address, loopback and the TLS
    certificate's names; () (not checked) when bound to every interface with none given."""
    given = _split(getattr(args, "allowed_hosts", []))
    bound = str(getattr(args, "host", "") or "").strip("[]")
    if "*" in given:
        return ("*",)
    if bound in WILDCARDS and not given:
        return ()
    names = given + LOOPBACK_NAMES + certificate_names(getattr(args, "ssl_certfile", None))
    return tuple(dict.fromkeys(names + (() if bound in WILDCARDS else (bound,))))


def http_options_of(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> HttpGuard:
    """The HttpGuard the flags (and $DIST_INFER_API_KEY) ask for. A ValueError says what is
    inconsistent (e.g. a key file without a certificate)."""
    env = os.environ if environ is None else environ
    api_keys = tuple(args.api_key) + _split([env.get(API_KEY_ENV, "")])
    return HttpGuard(
        api_keys=tuple(dict.fromkeys(api_keys)),
        admin_keys=tuple(args.admin_key),
        protect_metrics=args.protect_metrics,
        allowed_origins=_split(args.allowed_origins),
        prefix_cache_isolation=getattr(args, "prefix_cache_isolation", None),
        allowed_hosts=allowed_hosts_of(args),
        max_body_bytes=args.max_body_bytes,
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
    )
