"""`dist-infer bench-serve`: a load generator for any OpenAI-compatible completion server.

It sends streamed /v1/completions (or /v1/chat/completions) requests on an arrival schedule
(all at once, Poisson, gamma with a burstiness factor, or a trace's own timestamps), records
when every content chunk arrives, and reports TTFT, TPOT, ITL and E2E latency percentiles,
throughput and goodput under SLOs.

The maths (arrival gaps, length sampling, dataset and SSE parsing, SLO parsing, metrics) are
pure functions so the tests check them without a server; only `run_load` does I/O. Nothing is
server-specific: the requests use the OpenAI fields (plus `ignore_eos`, only when asked for), and
the responses are read from the OpenAI streaming format, with vLLM-style extras (`token_ids` in
a choice, usage in every chunk) used when present.
"""

from __future__ import annotations

import importlib.util

import argparse
import asyncio
import csv
import dataclasses
import json
import math
import os
import ssl
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import numpy as np
from loguru import logger

SLO_METRICS = ("ttft", "tpot", "e2e")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
TOKENS_PER_WORD = 1.3  # English words -> tokens, for ShareGPT text when there is no tokenizer
SYNTHETIC_SIGMA = 0.7  # spread of log(length) for synthetic lengths: a chat-trace-like long tail
API_KEY_ENVS = ("OPENAI_API_KEY", "DIST_INFER_API_KEY")  # where --api-key comes from when not given
FIRST_RANDOM_ID = 10  # random prompt ids start here so they avoid the usual special tokens (bos, eos, pad)

# Short common words: most tokenizers map " word" to one token, so N words are about N tokens.
PROMPT_WORDS = (
    "the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are", "as",
    "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by", "word", "but",
    "not", "what", "all", "were", "we", "when", "your", "can", "said", "there", "use", "an", "each",
    "which", "she", "do", "how", "their", "if", "will", "up", "other", "about", "out", "many", "then",
    "them", "these", "so", "some", "her", "would", "make", "like", "him", "into", "time", "has", "look",
    "two", "more", "write", "go", "see", "number", "no", "way", "could", "people", "my", "than", "first",
    "water", "been", "call", "who", "oil", "its", "now", "find", "long", "down", "day", "did", "get",
    "come", "made", "may", "part", "over", "new", "sound", "take", "only", "little", "work", "know",
    "place", "year", "live", "me", "back", "give", "most", "very", "after", "thing", "our", "just",
    "name", "good", "sentence", "man", "think", "say", "great", "where", "help", "through", "much",
)

# Column names accepted in a CSV trace, compared lowercase with everything but letters and digits
# dropped: Azure LLM inference traces (TIMESTAMP, ContextTokens, GeneratedTokens) and BurstGPT
# (Timestamp, Request tokens, Response tokens), plus a few obvious spellings.
TRACE_COLUMNS = {
    "timestamp": ("timestamp", "time", "arrivaltime", "arrivaltimestamp"),
    "context tokens": ("contexttokens", "requesttokens", "inputtokens", "prompttokens", "inputlen", "promptlen"),
    "generated tokens": ("generatedtokens", "responsetokens", "outputtokens", "completiontokens", "outputlen"),
}


class InputError(ValueError):
    """Bad user input (a flag value, a dataset file): reported as one line, exit code 2."""


# ---------------------------------------------------------------- flags


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
    try:
        return parse_slo(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def add_bench_serve_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `dist-infer bench-serve`."""
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="base URL of the server (default %(default)s); /v1/... is appended")
    p.add_argument("--model", default=None,
                   help="model name sent in every request (default: the first id listed by GET URL/v1/models)")
    p.add_argument("--endpoint", choices=tuple(ENDPOINT_PATHS), default="completions",
                   help="completions: POST /v1/completions with a prompt (default); chat: POST /v1/chat/completions "
                        "with one user message")
    p.add_argument("--num-prompts", type=_positive_int, default=100,
                   help="requests to send (default %(default)s); a dataset with fewer entries sends all it has")
    p.add_argument("--request-rate", type=_positive_float, default=None,
                   help="mean requests per second (default: inf, all sent at once; with a CSV trace, the trace's "
                        "own timestamps)")
    p.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="shape of the gamma distribution the gaps between arrivals are drawn from, mean 1/rate: "
                        "1 is Poisson (default), below 1 burstier, above 1 more regular")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of arrivals, synthetic lengths, random prompts and ShareGPT sampling (default %(default)s)")
    p.add_argument("--dataset", default="synthetic",
                   help="synthetic (default): random prompts with lengths around --input-len/--output-len; or a "
                        "ShareGPT-format .json file (first human turn is the prompt, the first gpt reply's token "
                        "count the output length); or a .csv trace with timestamp, context-token and generated-token "
                        "columns (Azure LLM inference trace or BurstGPT headers)")
    p.add_argument("--time-scale", type=_positive_float, default=1.0,
                   help="CSV traces: multiply the gaps between the trace's timestamps by this (0.5 = twice as fast; "
                        "default %(default)s)")
    p.add_argument("--input-len", type=_positive_int, default=128,
                   help="synthetic: mean prompt length in tokens (default %(default)s); lengths are lognormal, "
                        "clipped to [1, 4 x mean]")
    p.add_argument("--output-len", type=_positive_int, default=64,
                   help="synthetic: mean output length in tokens, sent as max_tokens (default %(default)s); "
                        "lognormal, clipped to [1, 4 x mean]")
    p.add_argument("--max-input-len", type=_positive_int, default=None,
                   help="synthetic and CSV traces: clip prompt lengths to this many tokens; ShareGPT: skip longer "
                        "prompts (default: no limit)")
    p.add_argument("--prompt-ids", action="store_true",
                   help="send prompts as lists of token ids instead of text (completions only): random ids in "
                        "[10, --vocab-size) for synthetic and trace prompts, --tokenizer ids for ShareGPT")
    p.add_argument("--vocab-size", type=_positive_int, default=1000,
                   help="--prompt-ids: random ids are drawn below this (default %(default)s)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a tokenizer.json (or a directory holding one) to count ShareGPT tokens exactly and to encode "
                        "them for --prompt-ids (default: words x 1.3, no ids)")
    p.add_argument("--max-concurrency", type=_positive_int, default=None,
                   help="at most this many requests in flight; a request that arrives when the cap is reached waits "
                        "(default: no cap)")
    p.add_argument("--slo", type=_slo_arg, default=None, metavar="ttft=S,tpot=S,e2e=S",
                   help="latency limits in seconds, any of ttft, tpot, e2e; goodput = completed requests per second "
                        "that meet every limit given (default: no goodput)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: true (vLLM and this project's server accept it) so every request "
                        "generates exactly max_tokens")
    p.add_argument("--timeout", type=_positive_float, default=600.0,
                   help="seconds one request may take, stream included, before it counts as failed "
                        "(default %(default)s)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="send 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, else $DIST_INFER_API_KEY, "
                        "else none)")
    p.add_argument("--insecure", action="store_true",
                   help="for an https:// --url: do not verify the server's certificate (a self-signed test server)")
    p.add_argument("--ca-cert", default=None, metavar="FILE",
                   help="for an https:// --url: verify the server's certificate against this CA bundle (PEM)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the results as the last stdout line")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write CDFs of TTFT, TPOT, ITL and E2E (2x2 grid, p50 and p99 marked) to this PNG")
    p.add_argument("--save-results", default=None, metavar="FILE.json",
                   help="write the summary and one record per request (send time, chunk times, TTFT, ITL, E2E, "
                        "tokens, error) to this JSON file")


# ---------------------------------------------------------------- arrivals and lengths


def gamma_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """n gaps (s) between arrivals: gamma with shape=burstiness and mean 1/rate (shape 1 = Poisson).

    Variance is 1/(rate^2 * burstiness), so burstiness < 1 clumps requests and > 1 evens them out
    while the mean rate stays the same. An infinite rate gives zero gaps (all at once).
    """
    if not rate > 0 or not burstiness > 0:
        raise InputError(f"rate ({rate}) and burstiness ({burstiness}) must be positive")
    if math.isinf(rate):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s after the start) of n requests; the first goes at 0."""
    gaps = gamma_gaps(max(n - 1, 0), rate, burstiness, rng)
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]


def trace_offsets(timestamps: Sequence[float], time_scale: float = 1.0) -> np.ndarray:
    """A trace's timestamps as send times relative to its first, gaps multiplied by time_scale."""
    stamps = np.asarray(timestamps, dtype=float)
    if stamps.size == 0:
        return stamps
    return (stamps - stamps.min()) * time_scale


def synthetic_lengths(n: int, mean: int, rng: np.random.Generator, sigma: float = SYNTHETIC_SIGMA) -> np.ndarray:
    """n lengths, lognormal like chat traces (most short, a long tail), clipped to [1, 4*mean].

    mu is set so the unclipped mean is `mean`; the clip at 4x trims about 1% of draws, which
    lowers the mean by a few percent.
    """
    mu = math.log(mean) - sigma * sigma / 2
    lengths = np.rint(rng.lognormal(mu, sigma, size=n))
    return np.clip(lengths, 1, 4 * mean).astype(int)


# ---------------------------------------------------------------- datasets


@dataclasses.dataclass(frozen=True)
class DatasetEntry:
    """One request as a dataset describes it, before a prompt is made for it."""

    input_len: int
    output_len: int
    prompt: Optional[str] = None  # ShareGPT text; None: make a random prompt of input_len tokens
    timestamp: Optional[float] = None  # CSV traces: arrival time in seconds (any origin)


def approx_token_count(text: str) -> int:
    """Token count of English text without a tokenizer: words x 1.3 (at least 1)."""
    return max(1, round(len(text.split()) * TOKENS_PER_WORD))


def synthetic_entries(n: int, input_len: int, output_len: int, rng: np.random.Generator) -> list[DatasetEntry]:
    inputs = synthetic_lengths(n, input_len, rng)
    outputs = synthetic_lengths(n, output_len, rng)
    return [DatasetEntry(int(i), int(o)) for i, o in zip(inputs, outputs)]


def load_sharegpt(path: Union[str, Path], count_tokens: Callable[[str], int] = approx_token_count) -> list[DatasetEntry]:
    """Entries of a ShareGPT JSON file: the first human turn is the prompt, the first gpt reply
    after it sets the output length. Conversations without both are skipped."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"dataset file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read dataset file {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise InputError(f"{path}: a ShareGPT file is a JSON list of {{\"conversations\": [...]}}, "
                         f"not a {type(data).__name__}")
    entries = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            continue
        prompt = reply = None
        for turn in turns:
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                continue
            speaker = str(turn.get("from", "")).lower()
            if prompt is None and speaker in ("human", "user"):
                prompt = turn["value"]
            elif prompt is not None and speaker in ("gpt", "assistant", "chatgpt"):
                reply = turn["value"]
                break
        if prompt and reply and prompt.strip() and reply.strip():
            entries.append(DatasetEntry(count_tokens(prompt), max(1, count_tokens(reply)), prompt=prompt))
    if not entries:
        raise InputError(f"{path}: no conversation with a human turn followed by a gpt reply")
    return entries


def _normalized(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _parse_timestamp(text: str) -> float:
    """Seconds from a number (BurstGPT) or a date-time string (Azure: `2023-11-16 18:15:46.6805900`)."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    stamp = datetime.fromisoformat(text)  # ValueError for junk
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)  # only differences matter; avoid local DST jumps
    return stamp.timestamp()


def _parse_tokens(text: str) -> int:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError(text)
    return int(value)


def load_trace_csv(path: Union[str, Path]) -> list[DatasetEntry]:
    """Entries of a CSV trace, sorted by timestamp. Token counts of 0 (BurstGPT's failed
    requests) become 1 so the arrival pattern is kept whole."""
    path = Path(path)
    try:
        handle = path.open(newline="", encoding="utf-8-sig")
    except FileNotFoundError:
        raise InputError(f"dataset file {path} does not exist") from None
    except OSError as exc:
        raise InputError(f"cannot read dataset file {path}: {exc}") from None
    with handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if not header:
            raise InputError(f"{path}: empty file, expected a header line")
        by_name = {_normalized(name): index for index, name in enumerate(header)}
        columns = {}
        for what, accepted in TRACE_COLUMNS.items():
            found = [by_name[name] for name in accepted if name in by_name]
            if not found:
                raise InputError(f"{path}: no {what} column (accepted: {', '.join(accepted)}, any case and "
                                 f"spacing); the header has: {', '.join(header)}")
            columns[what] = found[0]
        entries = []
        for line_number, row in enumerate(reader, start=2):
            if not any(cell.strip() for cell in row):
                continue
            values = {}
            for what, index in columns.items():
                cell = row[index] if index < len(row) else ""
                try:
                    values[what] = _parse_timestamp(cell) if what == "timestamp" else _parse_tokens(cell)
                except ValueError:
                    raise InputError(f"{path}:{line_number}: bad {header[index]!r} value {cell!r}") from None
            entries.append(DatasetEntry(max(1, values["context tokens"]), max(1, values["generated tokens"]),
                                        timestamp=values["timestamp"]))
    if not entries:
        raise InputError(f"{path}: the trace has a header but no rows")
    entries.sort(key=lambda entry: entry.timestamp)
    return entries


def load_tokenizer_counter(path: Union[str, Path]):
    """(count, encode) functions of a local tokenizer.json, for exact ShareGPT lengths and ids."""
    from tokenizers import Tokenizer

    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise InputError(f"tokenizer file {file} does not exist")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # the tokenizers library raises plain Exception for a malformed file
        raise InputError(f"cannot load tokenizer {file}: {exc}") from None

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    return (lambda text: max(1, len(encode(text)))), encode


def dataset_kind(dataset: str) -> str:
    """synthetic, sharegpt or trace: by name, by extension, else by the file's first character."""
    if dataset == "synthetic":
        return "synthetic"
    path = Path(dataset)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "trace"
    if suffix == ".json":
        return "sharegpt"
    if not path.exists():
        raise InputError(f"dataset file {path} does not exist (or use --dataset synthetic)")
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            start = handle.read(4096).lstrip()
    except OSError as exc:
        raise InputError(f"cannot read dataset file {path}: {exc}") from None
    return "sharegpt" if start.startswith("[") else "trace"


# ---------------------------------------------------------------- requests


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """What is sent, and when (seconds after the start)."""

    index: int
    prompt: Union[str, list[int]]
    input_len: int
    output_len: int
    arrival_s: float


def random_text_prompt(n_tokens: int, rng: np.random.Generator) -> str:
    return " ".join(PROMPT_WORDS[i] for i in rng.integers(0, len(PROMPT_WORDS), size=n_tokens))


def random_id_prompt(n_tokens: int, vocab_size: int, rng: np.random.Generator) -> list[int]:
    return [int(i) for i in rng.integers(FIRST_RANDOM_ID, vocab_size, size=n_tokens)]


def build_requests(args: argparse.Namespace, rng: np.random.Generator) -> tuple[list[BenchRequest], str]:
    """The requests of this run and a phrase saying how they arrive."""
    kind = dataset_kind(args.dataset)
    if args.prompt_ids and args.endpoint == "chat":
        raise InputError("--prompt-ids needs --endpoint completions (chat messages are text)")
    if args.prompt_ids and args.vocab_size <= FIRST_RANDOM_ID:
        raise InputError(f"--vocab-size must be above {FIRST_RANDOM_ID} (random ids start there)")
    count_tokens, encode = approx_token_count, None
    if args.tokenizer:
        count_tokens, encode = load_tokenizer_counter(args.tokenizer)
    if kind == "synthetic":
        entries = synthetic_entries(args.num_prompts, args.input_len, args.output_len, rng)
    elif kind == "sharegpt":
        if args.prompt_ids and encode is None:
            raise InputError("--prompt-ids with a ShareGPT dataset needs --tokenizer to turn the text into ids")
        entries = load_sharegpt(args.dataset, count_tokens)
        if args.max_input_len:
            kept = [entry for entry in entries if entry.input_len <= args.max_input_len]
            if not kept:
                raise InputError(f"{args.dataset}: no prompt is within --max-input-len {args.max_input_len}")
            entries = kept
        entries = [entries[i] for i in rng.permutation(len(entries))]
    else:
        entries = load_trace_csv(args.dataset)
    if len(entries) < args.num_prompts:
        logger.warning(f"{args.dataset} has {len(entries)} usable entries, fewer than --num-prompts "
                       f"{args.num_prompts}: sending {len(entries)}")
    entries = entries[:args.num_prompts]
    if args.max_input_len and kind != "sharegpt":
        entries = [dataclasses.replace(e, input_len=min(e.input_len, args.max_input_len)) for e in entries]

    if kind == "trace" and args.request_rate is None:
        offsets = trace_offsets([entry.timestamp for entry in entries], args.time_scale)
        arrivals = f"trace timestamps x {args.time_scale:g}"
    else:
        rate = args.request_rate if args.request_rate is not None else math.inf
        offsets = arrival_offsets(len(entries), rate, args.burstiness, rng)
        arrivals = ("all at once" if math.isinf(rate) else
                    f"{'Poisson' if args.burstiness == 1 else f'gamma (burstiness {args.burstiness:g})'} "
                    f"at {rate:g} req/s")

    requests = []
    for index, (entry, offset) in enumerate(zip(entries, offsets)):
        if entry.prompt is not None:
            prompt: Union[str, list[int]] = encode(entry.prompt) if args.prompt_ids else entry.prompt
        elif args.prompt_ids:
            prompt = random_id_prompt(entry.input_len, args.vocab_size, rng)
        else:
            prompt = random_text_prompt(entry.input_len, rng)
        requests.append(BenchRequest(index, prompt, entry.input_len, entry.output_len, float(offset)))
    return requests, arrivals


def request_payload(request: BenchRequest, model: str, endpoint: str, ignore_eos: bool) -> dict[str, Any]:
    """The JSON body: streamed, greedy, max_tokens = the request's output length."""
    body: dict[str, Any] = {"model": model}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    body.update({"max_tokens": request.output_len, "temperature": 0.0, "stream": True,
                 "stream_options": {"include_usage": True}})
    if ignore_eos:
        body["ignore_eos"] = True
    return body


# ---------------------------------------------------------------- server-sent events


class SSELine(NamedTuple):
    """One line of an event stream: kind is 'data' (with the decoded JSON), 'done' or 'skip'."""

    kind: str
    data: Optional[dict] = None


def parse_sse_line(line: str) -> SSELine:
    """Decode one SSE line. Blank lines, comments (`: ping`) and other fields are 'skip';
    `data: [DONE]` ends the stream; other data must be a JSON object (ValueError if not)."""
    line = line.strip("\r\n")
    if not line.startswith("data:"):
        return SSELine("skip")
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return SSELine("done")
    if not payload:
        return SSELine("skip")
    try:
        data = json.loads(payload)
    except json.JSONDecodeError:
        raise ValueError(f"undecodable event data: {payload[:200]!r}") from None
    if not isinstance(data, dict):
        raise ValueError(f"event data is not a JSON object: {payload[:200]!r}")
    return SSELine("data", data)


class ChunkContent(NamedTuple):
    """What one streamed chunk carries."""

    text: str
    tokens: int  # new tokens in this chunk: len(token_ids), else the usage increase, else 1 if text
    completion_tokens: Optional[int]  # usage.completion_tokens if the chunk has usage
    prompt_tokens: Optional[int]
    error: Optional[str]


def chunk_content(event: dict, completion_tokens_so_far: Optional[int] = None) -> ChunkContent:
    """Text and token count of one completions or chat chunk (an in-stream error is reported too)."""
    if event.get("error"):
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        return ChunkContent("", 0, None, None, f"error in stream: {message}")
    usage = event.get("usage") if isinstance(event.get("usage"), dict) else {}
    completion = usage.get("completion_tokens")
    prompt = usage.get("prompt_tokens")
    text, token_ids = "", None
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") or choice.get("message")  # message: a whole non-streamed chat answer
        delta = delta if isinstance(delta, dict) else {}
        piece = choice.get("text") if "text" in choice else (delta.get("content") or delta.get("reasoning_content"))
        text += piece or ""
        ids = choice.get("token_ids") or delta.get("token_ids")
        if isinstance(ids, list):
            token_ids = (token_ids or []) + ids
    if token_ids is not None:
        tokens = len(token_ids)
    elif text and isinstance(completion, int) and isinstance(completion_tokens_so_far, int):
        tokens = max(1, completion - completion_tokens_so_far)  # usage in every chunk (vLLM continuous stats)
    else:
        tokens = 1 if text else 0
    return ChunkContent(text, tokens, completion if isinstance(completion, int) else None,
                        prompt if isinstance(prompt, int) else None, None)


def inter_token_latencies(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Gaps between content chunks; a chunk of k tokens adds k gaps of (its gap / k), so ITL
    stays per token when a server batches tokens into one chunk."""
    itl = []
    for i in range(1, len(chunk_times)):
        gap = chunk_times[i] - chunk_times[i - 1]
        k = max(1, int(chunk_tokens[i]))
        itl.extend([gap / k] * k)
    return itl


# ---------------------------------------------------------------- per-request records and metrics


@dataclasses.dataclass
class RequestRecord:
    """What happened to one request; times in seconds, send/chunk times relative to the run's start."""

    index: int
    input_len: int
    output_len: int  # max_tokens asked for
    send_time: float = 0.0
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)
    ttft: Optional[float] = None
    itl: list[float] = dataclasses.field(default_factory=list)
    e2e: Optional[float] = None
    output_tokens: int = 0
    prompt_tokens: Optional[int] = None  # as the server's usage reports it
    success: bool = False
    error: str = ""

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first; None with fewer than 2 tokens."""
        if not self.success or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def latency_stats(values: Sequence[float]) -> dict[str, Optional[float]]:
    """mean, median and p99 in milliseconds (None for no values, so the JSON stays valid)."""
    if len(values) == 0:
        return {"mean": None, "median": None, "p99": None}
    ms = np.asarray(values, dtype=float) * 1000.0
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "p99": float(np.percentile(ms, 99))}


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """A successful request meets every given limit; with <2 tokens TPOT has no gaps to break
    it, and with no content chunk its TTFT is its E2E."""
    if not record.success:
        return False
    measured = {"ttft": record.ttft if record.ttft is not None else record.e2e,
                "tpot": record.tpot or 0.0, "e2e": record.e2e}
    return all(measured[name] is not None and measured[name] <= limit for name, limit in slo.items())


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slo: Optional[dict[str, float]] = None) -> dict[str, Any]:
    """Counts, throughputs, goodput and latency stats over the successful requests."""
    done = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    errors = _error_counts([r.error for r in failed])
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(failed),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "slo": dict(slo) if slo else None,
        "goodput": per_s(sum(meets_slo(r, slo) for r in done)) if slo else None,
        "ttft_ms": latency_stats([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": latency_stats([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": latency_stats([gap for r in done for gap in r.itl]),
        "e2e_ms": latency_stats([r.e2e for r in done if r.e2e is not None]),
        "errors": errors,
    }
    return summary


def _error_counts(errors: Sequence[str], keep: int = 10) -> dict[str, int]:
    """The most frequent error texts with their counts; the rest lumped into one entry so a run
    with many distinct errors (ids in the text) keeps a small summary."""
    counts: dict[str, int] = {}
    for error in errors:
        counts[error] = counts.get(error, 0) + 1
    ranked = sorted(counts.items(), key=lambda item: -item[1])
    kept = dict(ranked[:keep])
    if len(ranked) > keep:
        kept[f"({len(ranked) - keep} other error texts)"] = sum(count for _, count in ranked[keep:])
    return kept


def _number(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_report(summary: dict[str, Any]) -> str:
    """The human-readable table printed on stdout."""
    rows = [
        ("Model", summary.get("model", "-")),
        ("Endpoint", summary.get("endpoint_url", "-")),
        ("Arrivals", summary.get("arrivals", "-")),
        ("Max concurrency", summary.get("max_concurrency") or "none"),
        ("Completed requests", summary["completed"]),
        ("Failed requests", summary["failed"]),
        ("Duration (s)", _number(summary["duration_s"])),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total output tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", _number(summary["request_throughput"])),
        ("Output token throughput (tok/s)", _number(summary["output_throughput"])),
        ("Total token throughput (tok/s)", _number(summary["total_token_throughput"])),
    ]
    if summary.get("slo"):
        limits = ", ".join(f"{name} <= {limit:g} s" for name, limit in summary["slo"].items())
        rows.append(("Goodput (req/s)", f"{_number(summary['goodput'])}  ({limits})"))
    width = max(len(label) for label, _ in rows) + 2
    lines = ["=" * 20 + " bench-serve " + "=" * 20]
    lines += [f"{label + ':':<{width}}{value}" for label, value in rows]
    lines.append(f"{'latency (ms)':<14}{'mean':>12}{'median':>12}{'p99':>12}")
    for name in LATENCY_METRICS:
        stats = summary[f"{name}_ms"]
        lines.append(f"{name.upper():<14}" + "".join(f"{_number(stats[key]):>12}" for key in ("mean", "median", "p99")))
    errors = list(summary["errors"].items())  # most frequent first
    for error, count in errors[:5]:
        lines.append(f"failed x{count}: {error[:300]}")
    if len(errors) > 5:
        lines.append(f"failed x{sum(count for _, count in errors[5:])}: other errors (see --save-results)")
    lines.append("=" * 53)
    return "\n".join(lines)


def plot_cdfs(records: Sequence[RequestRecord], path: Union[str, Path]) -> None:
    """CDFs of TTFT, TPOT, ITL and E2E (ms) in a 2x2 grid with p50 and p99 marked, as a PNG.

    Uses a bare matplotlib Figure (Agg canvas) rather than pyplot, so no global figure state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    done = [r for r in records if r.success]
    series = {
        "TTFT": [r.ttft for r in done if r.ttft is not None],
        "TPOT": [r.tpot for r in done if r.tpot is not None],
        "ITL": [gap for r in done for gap in r.itl],
        "E2E": [r.e2e for r in done if r.e2e is not None],
    }
    figure = Figure(figsize=(11, 8))
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 2)
    for ax, (name, values) in zip(axes.flat, series.items()):
        ax.set_title(f"{name} ({len(values)} values)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction <= x")
        ax.grid(True, alpha=0.3)
        if not values:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        ms = np.sort(np.asarray(values, dtype=float) * 1000.0)
        ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post")
        for q, style in ((50, "--"), (99, ":")):
            value = float(np.percentile(ms, q))
            ax.axvline(value, linestyle=style, color="tab:red" if q == 99 else "tab:green",
                       label=f"p{q} {value:.2f} ms")
        ax.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(str(path), format="png", dpi=100)


# ---------------------------------------------------------------- I/O


def api_key_of(flag: Optional[str], environ: Optional[dict] = None) -> Optional[str]:
    """--api-key, else the first of API_KEY_ENVS that is set."""
    environ = os.environ if environ is None else environ
    return flag or next((environ[name] for name in API_KEY_ENVS if environ.get(name)), None)


def tls_verify_of(insecure: bool, ca_cert: Optional[str]) -> Union[bool, ssl.SSLContext]:
    """httpx's `verify`: off with --insecure, a context trusting --ca-cert, else the system's CAs."""
    if insecure:
        return False
    if ca_cert:
        try:
            return ssl.create_default_context(cafile=ca_cert)
        except (OSError, ssl.SSLError) as exc:
            raise InputError(f"--ca-cert {ca_cert}: {exc}") from None
    return True


def normalized_base_url(url: str) -> str:
    """Without a trailing slash or /v1, so endpoint paths can be appended."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def default_model(client, base_url: str) -> str:
    """The first model id of GET /v1/models."""
    try:
        response = await client.get(base_url + "/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
        return str(models[0]["id"])
    except Exception as exc:
        raise InputError(f"cannot read the model name from {base_url}/v1/models ({type(exc).__name__}: {exc}); "
                         f"pass --model") from None


async def stream_request(client, url: str, payload: dict, record: RequestRecord, start: float) -> None:
    """Send one streamed request, filling `record` as chunks arrive (so a timeout keeps what came)."""
    sent = time.perf_counter()
    record.send_time = sent - start
    completion_tokens: Optional[int] = None
    counted_tokens = 0
    ended: Optional[float] = None  # when [DONE] came
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode("utf-8", errors="replace")
            record.error = f"HTTP {response.status_code}: {body.strip()[:2000]}"
            record.e2e = time.perf_counter() - sent
            return
        if response.headers.get("content-type", "").startswith("application/json"):
            lines = ["data: " + (await response.aread()).decode("utf-8", errors="replace"), "data: [DONE]"]
            source = _as_async(lines)  # a server that ignored stream: true; one chunk with everything
        else:
            source = response.aiter_lines()
        async for line in source:
            now = time.perf_counter()
            try:
                event = parse_sse_line(line)
            except ValueError as exc:
                record.error = str(exc)
                record.e2e = now - sent
                return
            if event.kind == "done":
                ended = now
                break
            if event.kind != "data":
                continue
            content = chunk_content(event.data, completion_tokens)
            if content.error:
                record.error = content.error
                record.e2e = now - sent
                return
            if content.completion_tokens is not None:
                completion_tokens = content.completion_tokens
            if content.prompt_tokens is not None:
                record.prompt_tokens = content.prompt_tokens
            if content.tokens or content.text:
                if record.ttft is None:
                    record.ttft = now - sent
                record.chunk_times.append(now - start)
                record.chunk_tokens.append(content.tokens)
                counted_tokens += content.tokens
    record.e2e = (ended if ended is not None else time.perf_counter()) - sent
    record.output_tokens = completion_tokens if completion_tokens is not None else counted_tokens
    record.itl = inter_token_latencies(record.chunk_times, record.chunk_tokens)
    if ended is None and not record.chunk_times:
        record.error = "stream ended with no content and no [DONE]"
        return
    record.success = True


async def _as_async(items):
    for item in items:
        yield item


async def run_load(requests: Sequence[BenchRequest], base_url: str, model: Optional[str], endpoint: str,
                   ignore_eos: bool, max_concurrency: Optional[int], timeout_s: float,
                   progress: Optional[Callable[[RequestRecord], None]] = None, api_key: Optional[str] = None,
                   verify: Union[bool, ssl.SSLContext] = True) -> tuple[list[RequestRecord], float, str]:
    """Send every request at its arrival time; returns the records, the run's duration and the model.
    api_key: sent as a Bearer token; verify: httpx's TLS verification (see tls_verify_of)."""
    try:
        import httpx
    except ImportError:
        raise InputError("bench-serve needs httpx: pip install httpx (or dist_infer[serve])") from None

    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    deadline = None if math.isinf(timeout_s) else timeout_s
    # trust_env=False: a benchmark must reach the server directly, not through an HTTP(S)_PROXY
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(deadline), limits=limits, trust_env=False, headers=headers,
                                 verify=verify) as client:
        if model is None:
            model = await default_model(client, base_url)
            logger.info(f"model {model!r} (first of {base_url}/v1/models)")
        url = base_url + ENDPOINT_PATHS[endpoint]
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        start = time.perf_counter()

        async def one(request: BenchRequest) -> RequestRecord:
            record = RequestRecord(request.index, request.input_len, request.output_len)
            delay = request.arrival_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            payload = request_payload(request, model, endpoint, ignore_eos)
            if slots is not None:
                await slots.acquire()
            try:
                await asyncio.wait_for(stream_request(client, url, payload, record, start), deadline)
            except asyncio.TimeoutError:
                record.error = f"timed out after {timeout_s:g} s"
            except (httpx.HTTPError, OSError) as exc:
                record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            finally:
                if slots is not None:
                    slots.release()
            if not record.success and record.e2e is None:
                record.e2e = time.perf_counter() - start - record.send_time
            if progress is not None:
                progress(record)
            return record

        records = await asyncio.gather(*(one(request) for request in requests))
        duration = time.perf_counter() - start
    return list(records), duration, model


def _finite_or_none(value: Any) -> Any:
    """JSON without NaN/Infinity (strict parsers reject them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


def run_bench_serve(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 if every request succeeded, 1 if some failed, 2 for bad input."""
    from tqdm import tqdm

    try:
        slo = parse_slo(args.slo) if isinstance(args.slo, str) else args.slo
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise InputError("--plot needs matplotlib: pip install 'dist_infer[plot]'")
        for flag, output in (("--plot", args.plot), ("--save-results", args.save_results)):
            if output and not Path(output).resolve().parent.is_dir():  # fail now, not after the whole run
                raise InputError(f"{flag} {output}: directory {Path(output).resolve().parent} does not exist")
        rng = np.random.default_rng(args.seed)
        requests, arrivals = build_requests(args, rng)
        base_url = normalized_base_url(args.url)
        logger.info(f"{len(requests)} requests to {base_url}{ENDPOINT_PATHS[args.endpoint]}, arrivals: {arrivals}")
        with tqdm(total=len(requests), desc="bench-serve", unit="req", file=sys.stderr, disable=None) as bar:
            records, duration, model = asyncio.run(run_load(
                requests, base_url, args.model, args.endpoint, args.ignore_eos, args.max_concurrency,
                args.timeout, progress=lambda record: bar.update(1), api_key=api_key_of(args.api_key),
                verify=tls_verify_of(args.insecure, args.ca_cert)))
    except InputError as exc:
        print(f"bench-serve: error: {exc}", file=sys.stderr)
        return 2

    summary = {
        "model": model,
        "url": base_url,
        "endpoint": args.endpoint,
        "endpoint_url": base_url + ENDPOINT_PATHS[args.endpoint],
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "arrivals": arrivals,
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        **summarize(records, duration, slo),
    }
    summary = _finite_or_none(summary)
    print(format_report(summary))
    try:
        if args.save_results:
            document = {"summary": summary,
                        "requests": [dict(dataclasses.asdict(r), tpot=r.tpot) for r in records]}
            Path(args.save_results).write_text(json.dumps(_finite_or_none(document), indent=1))
            logger.info(f"per-request records written to {args.save_results}")
        if args.plot:
            plot_cdfs(records, args.plot)
            logger.info(f"latency CDFs written to {args.plot}")
    except OSError as exc:
        print(f"bench-serve: error: cannot write {exc.filename or 'output'}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, allow_nan=False), flush=True)
    return 0 if summary["failed"] == 0 else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Standalone entry point (`python -m dist_infer.launch.bench_serve ...`), same as the subcommand."""
    parser = argparse.ArgumentParser(prog="bench-serve", description=__doc__.splitlines()[0])
    add_bench_serve_flags(parser)
    return run_bench_serve(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
