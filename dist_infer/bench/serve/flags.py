"""The flags of `dist-infer bench-serve`, the --slo type and the error for bad input.

Kept free of numpy and httpx: the CLI's parser imports `add_bench_serve_flags` from here for every
command, and the other bench-serve modules take `InputError` and the endpoint paths from here. The
plain argument types (positive numbers) are the project's own, from `dist_infer.arg_types`.
"""

from __future__ import annotations

import argparse
import math

from dist_infer.arg_types import non_negative_float, positive_float, positive_int

SLO_METRICS = ("ttft", "tpot", "e2e")
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class InputError(ValueError):
    """Bad user input (a flag value, a dataset file): reported as one line, exit code 2."""


def parse_slo(text: str) -> dict[str, float]:
    """`ttft=0.5,tpot=0.05,e2e=10` -> {"ttft": 0.5, ...} in seconds; errors name the bad item."""
    slo: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, value_text = item.partition("=")
        name = name.strip().lower()
        if not sep:
            raise InputError(f"--slo item {item!r} is not NAME=SECONDS (e.g. ttft=0.5)")
        if name not in SLO_METRICS:
            raise InputError(f"--slo item {item!r}: unknown metric {name!r}; use {', '.join(SLO_METRICS)}")
        try:
            value = float(value_text)
        except ValueError:
            raise InputError(f"--slo item {item!r}: {value_text.strip()!r} is not a number of seconds") from None
        if not math.isfinite(value) or value <= 0:
            raise InputError(f"--slo item {item!r}: the limit must be a positive number of seconds")
        if name in slo:
            raise InputError(f"--slo item {item!r}: {name} is given twice")
        slo[name] = value
    if not slo:
        raise InputError(f"--slo {text!r} names no limit; use e.g. ttft=0.5,tpot=0.05")
    return slo


def _slo_arg(text: str) -> dict[str, float]:
    """parse_slo as an argparse type, so a bad --slo is a usage error before anything runs."""
    try:
        return parse_slo(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_bench_serve_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `dist-infer bench-serve`, in the order --help lists them."""
    _add_target_flags(p)
    _add_arrival_flags(p)
    _add_dataset_flags(p)
    _add_length_flags(p)
    _add_prompt_id_flags(p)
    _add_request_flags(p)
    _add_connection_flags(p)
    _add_output_flags(p)


def _add_target_flags(p: argparse.ArgumentParser) -> None:
    """The server, the model and the endpoint the requests go to."""
    p.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="base URL of the server (default %(default)s); /v1/... is appended",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model name sent in every request (default: the first id listed by GET URL/v1/models)",
    )
    p.add_argument(
        "--endpoint",
        choices=tuple(ENDPOINT_PATHS),
        default="completions",
        help="completions: POST /v1/completions with a prompt (default); chat: POST /v1/chat/completions "
        "with one user message (multi-turn: the whole conversation's messages)",
    )


def _add_arrival_flags(p: argparse.ArgumentParser) -> None:
    """How many requests are sent and when: the arrival process and its seed."""
    p.add_argument(
        "--num-prompts",
        type=positive_int,
        default=100,
        help="requests to send (default %(default)s); a dataset with fewer entries sends all it has",
    )
    p.add_argument(
        "--request-rate",
        type=positive_float,
        default=None,
        help="mean requests per second (default: inf, all sent at once; with a CSV trace, the trace's own timestamps)",
    )
    p.add_argument(
        "--burstiness",
        type=positive_float,
        default=1.0,
        help="shape of the gamma distribution the gaps between arrivals are drawn from, mean 1/rate: "
        "1 is Poisson (default), below 1 burstier, above 1 more regular",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of arrivals, synthetic lengths, random prompts and ShareGPT sampling (default %(default)s)",
    )


def _add_dataset_flags(p: argparse.ArgumentParser) -> None:
    """What is sent: the dataset and the shapes of its shared-prefix, multi-turn and trace forms."""
    p.add_argument(
        "--dataset",
        default="synthetic",
        help="synthetic (default): random prompts with lengths around --input-len/--output-len; prefix: "
        "shared-prefix prompts (--num-prefixes prefixes of --prefix-len tokens, each request one of "
        "them round robin + its own --suffix-len random tokens); multiturn: synthetic chats of "
        "--turns turns (a --prefix-len system prompt, --suffix-len user messages, --output-len "
        "answers), each turn sending the whole conversation so far; json-schema: --num-prompts JSON "
        "schemas of varied shapes (nested objects, bounded arrays, enums, patterns, anyOf, ranges; made "
        "from --seed), each asked for as a strict json_schema response_format and every answer checked "
        "against its schema (the validity rate is reported); copy: tasks whose answers repeat their "
        "prompt (rename a variable in code, rewrite a list as a table, copy a log's matching lines, fix "
        "a paragraph's typos; made from --seed), the stream speculative decoding serves; write: requests "
        "for new text on a topic, nothing to copy; or a ShareGPT-format .json file "
        "(first human turn is the prompt, the first gpt reply's token count the output length; with "
        "--multiturn every turn is replayed); or a .csv trace with timestamp, context-token and "
        "generated-token columns (Azure LLM inference trace or BurstGPT headers)",
    )
    p.add_argument(
        "--prefix-len",
        type=positive_int,
        default=256,
        help="prefix: tokens of each shared prefix; multiturn: tokens of the system prompt "
        "(default %(default)s). A text prefix is common words in sentences ending with a period, so "
        "it tokenizes the same in front of every suffix, but its token count is approximate (about "
        "one token a word); --prompt-ids makes it exact",
    )
    p.add_argument(
        "--num-prefixes",
        type=positive_int,
        default=10,
        help="prefix: distinct shared prefixes, request i uses prefix i mod this; multiturn: distinct "
        "system prompts, conversation i uses system prompt i mod this (default %(default)s)",
    )
    p.add_argument(
        "--suffix-len",
        type=positive_int,
        default=64,
        help="prefix: random tokens after the prefix, different for every request; multiturn: tokens of "
        "each user message (default %(default)s)",
    )
    p.add_argument(
        "--turns",
        type=positive_int,
        default=5,
        help="multiturn: turns (user message + answer) per conversation; ShareGPT with --multiturn: at "
        "most this many turns of each conversation (default %(default)s). Turn k+1 is sent when "
        "turn k has finished; --num-prompts counts conversations, --request-rate their first turns",
    )
    p.add_argument(
        "--multiturn",
        action="store_true",
        help="ShareGPT .json: replay whole conversations (every human turn, each sent with the "
        "conversation so far, the answers being what the server returned) instead of first turns",
    )
    p.add_argument(
        "--unconstrained",
        action="store_true",
        help="json-schema: send the same prompts without their response_format (the unconstrained "
        "baseline of the same stream; the answers are not checked)",
    )
    p.add_argument(
        "--replay-lengths",
        default=None,
        metavar="RESULTS.json",
        help="json-schema: request i asks for exactly as many tokens as request i generated in this "
        "--save-results file (with --unconstrained --ignore-eos: the constrained run's stream again, "
        "token for token, unconstrained)",
    )
    p.add_argument(
        "--time-scale",
        type=positive_float,
        default=1.0,
        help="CSV traces: multiply the gaps between the trace's timestamps by this (0.5 = twice as fast; "
        "default %(default)s)",
    )


def _add_length_flags(p: argparse.ArgumentParser) -> None:
    """The prompt and output lengths of synthetic requests, and the cap on every prompt's."""
    p.add_argument(
        "--input-len",
        type=positive_int,
        default=128,
        help="synthetic: mean prompt length in tokens (default %(default)s); lengths are lognormal, "
        "clipped to [1, 4 x mean]",
    )
    p.add_argument(
        "--output-len",
        type=positive_int,
        default=64,
        help="synthetic: mean output length in tokens, sent as max_tokens (default %(default)s); "
        "lognormal, clipped to [1, 4 x mean]; prefix and multiturn: exactly this max_tokens",
    )
    p.add_argument(
        "--max-input-len",
        type=positive_int,
        default=None,
        help="synthetic and CSV traces: clip prompt lengths to this many tokens; ShareGPT: skip longer "
        "prompts; multi-turn: end a conversation before a later turn whose prompt would be longer "
        "(default: no limit)",
    )


def _add_prompt_id_flags(p: argparse.ArgumentParser) -> None:
    """Prompts as token ids, and the tokenizer that counts and encodes ShareGPT text."""
    p.add_argument(
        "--prompt-ids",
        action="store_true",
        help="send prompts as lists of token ids instead of text (completions only): random ids in "
        "[10, --vocab-size) for synthetic, prefix, multiturn and trace prompts, --tokenizer ids "
        "for ShareGPT; multi-turn appends each answer's token ids as the server returns them "
        "(return_token_ids, as vLLM and this project's server do)",
    )
    p.add_argument(
        "--vocab-size",
        type=positive_int,
        default=1000,
        help="--prompt-ids: random ids are drawn below this (default %(default)s)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="a tokenizer.json (or a directory holding one) to count ShareGPT tokens exactly and to encode "
        "them for --prompt-ids (default: words x 1.3, no ids)",
    )


def _add_request_flags(p: argparse.ArgumentParser) -> None:
    """How each request is sent and judged: the concurrency cap, the SLO, ignore_eos, its timeout."""
    p.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="at most this many requests in flight; a request that arrives when the cap is reached waits "
        "(default: no cap)",
    )
    p.add_argument(
        "--slo",
        type=_slo_arg,
        default=None,
        metavar="ttft=S,tpot=S,e2e=S",
        help="latency limits in seconds, any of ttft, tpot, e2e; goodput = completed requests per second "
        "that meet every limit given (default: no goodput)",
    )
    p.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="sampling temperature of every request (default %(default)s: greedy)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos: true (vLLM and this project's server accept it) so every request "
        "generates exactly max_tokens",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=600.0,
        help="seconds one request may take, stream included, before it counts as failed (default %(default)s)",
    )


def _add_connection_flags(p: argparse.ArgumentParser) -> None:
    """The API key and TLS of the connection to the server."""
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="send 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, else $DIST_INFER_API_KEY, else none)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="for an https:// --url: do not verify the server's certificate (a self-signed test server)",
    )
    p.add_argument(
        "--ca-cert",
        default=None,
        metavar="FILE",
        help="for an https:// --url: verify the server's certificate against this CA bundle (PEM)",
    )


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """Where the results go besides the report: a JSON line, a PNG of CDFs, a JSON file."""
    p.add_argument("--json", action="store_true", help="print one JSON object with the results as the last stdout line")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="write CDFs of TTFT, TPOT, ITL and E2E (2x2 grid, p50 and p99 marked) to this PNG",
    )
    p.add_argument(
        "--save-results",
        default=None,
        metavar="FILE.json",
        help="write the summary and one record per request (send time, chunk times, TTFT, ITL, E2E, "
        "tokens, error) to this JSON file",
    )
