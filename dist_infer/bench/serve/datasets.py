"""What a run sends: synthetic prompts with chat-like lengths, shared-prefix prompts, a ShareGPT
file, or a CSV trace (Azure LLM inference or BurstGPT), turned into timed requests. (Multi-turn
conversations, sent turn by turn, are `conversations`.)

The lengths and prompts come from the run's one seeded generator, in a fixed order (lengths,
ShareGPT shuffle, arrivals, prompts; shared prefixes: prefixes, arrivals, suffixes), so the same
--seed sends the same requests.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
from loguru import logger

from dist_infer.bench.serve.arrivals import schedule
from dist_infer.bench.serve.copy_tasks import copy_prompt, write_prompt
from dist_infer.bench.serve.flags import InputError
from dist_infer.bench.serve.json_schemas import SchemaCase, schema_cases
from dist_infer.bench.serve.prompts import FIRST_RANDOM_ID, random_id_prompt, random_text_prompt, shared_prefixes

TOKENS_PER_WORD = 1.3  # English words -> tokens, for ShareGPT text when there is no tokenizer
SYNTHETIC_SIGMA = 0.7  # spread of log(length) for synthetic lengths: a chat-trace-like long tail

# Column names accepted in a CSV trace, compared lowercase with everything but letters and digits
# dropped: Azure LLM inference traces (TIMESTAMP, ContextTokens, GeneratedTokens) and BurstGPT
# (Timestamp, Request tokens, Response tokens), plus a few obvious spellings.
TRACE_COLUMNS = {
    "timestamp": ("timestamp", "time", "arrivaltime", "arrivaltimestamp"),
    "context tokens": ("contexttokens", "requesttokens", "inputtokens", "prompttokens", "inputlen", "promptlen"),
    "generated tokens": ("generatedtokens", "responsetokens", "outputtokens", "completiontokens", "outputlen"),
}


def synthetic_lengths(n: int, mean: int, rng: np.random.Generator, sigma: float = SYNTHETIC_SIGMA) -> np.ndarray:
    """n lengths, lognormal like chat traces (most short, a long tail), clipped to [1, 4*mean].

    mu is set so the unclipped mean is `mean`; the clip at 4x trims about 1% of draws, which
    lowers the mean by a few percent.
    """
    mu = math.log(mean) - sigma * sigma / 2
    lengths = np.rint(rng.lognormal(mu, sigma, size=n))
    return np.clip(lengths, 1, 4 * mean).astype(int)


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
    """n synthetic entries: all input lengths drawn first, then all output lengths (the seed's order)."""
    inputs = synthetic_lengths(n, input_len, rng)
    outputs = synthetic_lengths(n, output_len, rng)
    return [DatasetEntry(int(i), int(o)) for i, o in zip(inputs, outputs)]


def read_sharegpt(path: Union[str, Path]) -> list:
    """The JSON list of a ShareGPT file; errors name the file."""
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
        raise InputError(
            f'{path}: a ShareGPT file is a JSON list of {{"conversations": [...]}}, not a {type(data).__name__}'
        )
    return data


def load_sharegpt(
    path: Union[str, Path], count_tokens: Callable[[str], int] = approx_token_count
) -> list[DatasetEntry]:
    """Entries of a ShareGPT JSON file: the first human turn is the prompt, the first gpt reply
    after it sets the output length. Conversations without both are skipped."""
    entries = []
    for item in read_sharegpt(path):
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
    """A header name as TRACE_COLUMNS spells it: lowercase letters and digits only."""
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
    """A token count cell: a non-negative number (BurstGPT writes some as floats)."""
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
                raise InputError(
                    f"{path}: no {what} column (accepted: {', '.join(accepted)}, any case and "
                    f"spacing); the header has: {', '.join(header)}"
                )
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
            entries.append(
                DatasetEntry(
                    max(1, values["context tokens"]), max(1, values["generated tokens"]), timestamp=values["timestamp"]
                )
            )
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
    """synthetic, prefix, multiturn, json-schema, copy, write, sharegpt or trace: by name, by
    extension, else by the file's first character."""
    if dataset in ("synthetic", "prefix", "multiturn", "json-schema", "copy", "write"):
        return dataset
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


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """What is sent, and when (seconds after the start)."""

    index: int
    prompt: Union[str, list[int], list[dict]]  # text, token ids, or (chat, multi-turn) the messages so far
    input_len: int
    output_len: int
    arrival_s: float
    schema: Optional[SchemaCase] = None  # --dataset json-schema: the answer must be an instance of it


def json_schema_requests(args: argparse.Namespace, rng: np.random.Generator) -> tuple[list[BenchRequest], str]:
    """--dataset json-schema: request i asks for an instance of schema i (json_schemas.py, made
    from --seed), sent as a strict json_schema response_format (none with --unconstrained), with
    at most --output-len tokens (or, --replay-lengths, the tokens request i had in that run)."""
    if args.prompt_ids:
        raise InputError("--dataset json-schema sends text prompts (each names its schema): drop --prompt-ids")
    offsets, arrivals = schedule(args.num_prompts, None, args.request_rate, args.burstiness, args.time_scale, rng)
    cases = schema_cases(args.num_prompts, args.seed)
    unconstrained = getattr(args, "unconstrained", False)
    lengths = replayed_lengths(args.replay_lengths) if getattr(args, "replay_lengths", None) else {}
    requests = []
    for i, (case, offset) in enumerate(zip(cases, offsets)):
        schema = None if unconstrained else case
        out = lengths.get(i, args.output_len)
        requests.append(BenchRequest(i, case.prompt, approx_token_count(case.prompt), out, float(offset), schema))
    return requests, arrivals


def task_requests(args: argparse.Namespace, rng: np.random.Generator, kind: str) -> tuple[list[BenchRequest], str]:
    """--dataset copy / write: request i is a copy-heavy task (edit, rewrite, extract, fix: the answer
    repeats the prompt) or a writing task (nothing to copy), made from --seed, with at most
    --output-len tokens (copy_tasks.py)."""
    if args.prompt_ids:
        raise InputError(f"--dataset {kind} sends text prompts (tasks in words): drop --prompt-ids")
    offsets, arrivals = schedule(args.num_prompts, None, args.request_rate, args.burstiness, args.time_scale, rng)
    make = copy_prompt if kind == "copy" else write_prompt
    requests = []
    for i, offset in enumerate(offsets):
        prompt = make(rng)
        requests.append(BenchRequest(i, prompt, approx_token_count(prompt), args.output_len, float(offset)))
    return requests, arrivals


def replayed_lengths(path: Union[str, Path]) -> dict[int, int]:
    """Request index -> the tokens it generated, from a --save-results file (its successful requests)."""
    try:
        document = json.loads(Path(path).read_text())
        return {int(r["index"]): max(1, int(r["output_tokens"])) for r in document["requests"] if r.get("success")}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--replay-lengths {path}: not a readable --save-results file ({exc})") from None


def prefix_requests(args: argparse.Namespace, rng: np.random.Generator) -> tuple[list[BenchRequest], str]:
    """--dataset prefix: request i is prefix i mod --num-prefixes (round robin, so the groups are as
    equal as --num-prompts allows) followed by --suffix-len random tokens of its own, asking for
    exactly --output-len tokens. Text suffixes follow the prefix's final period after a space."""
    prefixes = shared_prefixes(args, rng)
    n = args.num_prompts
    offsets, arrivals = schedule(n, None, args.request_rate, args.burstiness, args.time_scale, rng)
    requests = []
    for index, offset in enumerate(offsets):
        prefix = prefixes[index % len(prefixes)]
        if args.prompt_ids:
            prompt: Union[str, list[int]] = prefix + random_id_prompt(args.suffix_len, args.vocab_size, rng)
        else:
            prompt = prefix + " " + random_text_prompt(args.suffix_len, rng)
        requests.append(BenchRequest(index, prompt, args.prefix_len + args.suffix_len, args.output_len, float(offset)))
    return requests, arrivals


def check_prompt_flags(args: argparse.Namespace) -> None:
    """--prompt-ids needs the completions endpoint and room above the special ids."""
    if args.prompt_ids and args.endpoint == "chat":
        raise InputError("--prompt-ids needs --endpoint completions (chat messages are text)")
    if args.prompt_ids and args.vocab_size <= FIRST_RANDOM_ID:
        raise InputError(f"--vocab-size must be above {FIRST_RANDOM_ID} (random ids start there)")


def build_requests(args: argparse.Namespace, rng: np.random.Generator) -> tuple[list[BenchRequest], str]:
    """The requests of this run and a phrase saying how they arrive (not for multi-turn runs, which
    `conversations` builds)."""
    kind = dataset_kind(args.dataset)
    check_prompt_flags(args)
    if getattr(args, "multiturn", False) or kind == "multiturn":
        raise InputError("multi-turn runs are built by conversations.build_conversations")
    if kind == "prefix":
        return prefix_requests(args, rng)
    if kind == "json-schema":
        return json_schema_requests(args, rng)
    if kind in ("copy", "write"):
        return task_requests(args, rng, kind)
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
        logger.warning(
            f"{args.dataset} has {len(entries)} usable entries, fewer than --num-prompts "
            f"{args.num_prompts}: sending {len(entries)}"
        )
    entries = entries[: args.num_prompts]
    if args.max_input_len and kind != "sharegpt":
        entries = [dataclasses.replace(e, input_len=min(e.input_len, args.max_input_len)) for e in entries]
    timestamps = [entry.timestamp for entry in entries] if kind == "trace" else None
    offsets, arrivals = schedule(len(entries), timestamps, args.request_rate, args.burstiness, args.time_scale, rng)

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
