"""Multi-turn chats for bench-serve, the user's side only: synthetic (`--dataset multiturn`) or the
whole conversations of a ShareGPT file (`--multiturn`). The assistant's side is whatever the
server answers during the run (`multiturn` sends the turns), so each turn's prompt is the real
conversation so far, as a chat client would send it.

Drawn from the run's seeded generator in a fixed order (system prompts or the ShareGPT shuffle,
then arrivals, then user messages), so the same --seed sends the same conversations.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
from loguru import logger

from dist_infer.bench.serve.arrivals import schedule
from dist_infer.bench.serve.datasets import (
    approx_token_count,
    check_prompt_flags,
    dataset_kind,
    load_tokenizer_counter,
    read_sharegpt,
)
from dist_infer.bench.serve.flags import InputError
from dist_infer.bench.serve.prompts import random_id_prompt, random_text_prompt, shared_prefixes

USER_SPEAKERS = ("human", "user")
ASSISTANT_SPEAKERS = ("gpt", "assistant", "chatgpt", "bard", "bing")


@dataclasses.dataclass(frozen=True)
class UserTurn:
    """One user message and how many tokens its answer may have (max_tokens)."""

    message: Union[str, list[int]]
    message_len: int  # tokens: exact for ids, approximate (or --tokenizer's) for text
    output_len: int


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A chat to replay: an optional system prompt, the user turns, and when its first turn is sent."""

    index: int
    system: Union[str, list[int], None]
    system_len: int
    turns: tuple[UserTurn, ...]
    arrival_s: float = 0.0


def is_multiturn(args: argparse.Namespace) -> bool:
    """Whether this run replays conversations turn by turn: --dataset multiturn, or --multiturn."""
    return args.dataset == "multiturn" or bool(getattr(args, "multiturn", False))


def sharegpt_turns(turns: list) -> tuple[Optional[str], list[tuple[str, str]]]:
    """A ShareGPT conversation's system prompt (a leading "system" turn) and its (user message,
    reply) pairs in order. Consecutive user turns are joined; replies before the first user turn
    are dropped; the pairs end at the first empty message (a later turn would lack its context)."""
    system: Optional[str] = None
    pairs: list[tuple[str, str]] = []
    user: Optional[str] = None
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            continue
        speaker, value = str(turn.get("from", "")).lower(), turn["value"]
        if speaker == "system" and not pairs and user is None:
            system = value if value.strip() else None
        elif speaker in USER_SPEAKERS:
            user = value if user is None else user + "\n" + value
        elif speaker in ASSISTANT_SPEAKERS and user is not None:
            if not user.strip() or not value.strip():
                break
            pairs.append((user, value))
            user = None
    return system, pairs


def load_sharegpt_conversations(
    path: Union[str, Path],
    count_tokens: Callable[[str], int],
    encode: Optional[Callable[[str], list[int]]],
    max_turns: int,
) -> list[Conversation]:
    """The conversations of a ShareGPT file with at least one answered user turn, at most max_turns
    each; a reply's token count is its turn's max_tokens. encode: send ids instead of text."""
    conversations = []
    for item in read_sharegpt(path):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            continue
        system, pairs = sharegpt_turns(turns)
        if not pairs:
            continue
        user_turns = tuple(
            UserTurn(encode(user) if encode else user, count_tokens(user), max(1, count_tokens(reply)))
            for user, reply in pairs[:max_turns]
        )
        system_prompt = (encode(system) if encode else system) if system else None
        conversations.append(
            Conversation(len(conversations), system_prompt, count_tokens(system) if system else 0, user_turns)
        )
    if not conversations:
        raise InputError(f"{path}: no conversation with a human turn followed by a gpt reply")
    return conversations


def synthetic_conversations(args: argparse.Namespace, rng: np.random.Generator) -> tuple[list[Conversation], str]:
    """--num-prompts chats of --turns turns: conversation i has system prompt i mod --num-prefixes
    (--prefix-len tokens, shared between conversations like an app's system prompt), then user
    messages of --suffix-len random tokens, each answer asking for exactly --output-len tokens."""
    systems = shared_prefixes(args, rng)
    n = args.num_prompts
    offsets, arrivals = schedule(n, None, args.request_rate, args.burstiness, args.time_scale, rng)
    arrivals += " (first turns; each later turn when the one before has finished)"
    conversations = []
    for index, offset in enumerate(offsets):
        turns = []
        for _ in range(args.turns):
            message: Union[str, list[int]] = (
                random_id_prompt(args.suffix_len, args.vocab_size, rng)
                if args.prompt_ids
                else random_text_prompt(args.suffix_len, rng)
            )
            turns.append(UserTurn(message, args.suffix_len, args.output_len))
        conversations.append(
            Conversation(index, systems[index % len(systems)], args.prefix_len, tuple(turns), float(offset))
        )
    return conversations, arrivals


def build_conversations(args: argparse.Namespace, rng: np.random.Generator) -> tuple[list[Conversation], str]:
    """The conversations of a multi-turn run, with their first turns' arrival times, and a phrase
    saying how they arrive."""
    check_prompt_flags(args)
    kind = dataset_kind(args.dataset)
    if kind == "multiturn":
        return synthetic_conversations(args, rng)
    if kind != "sharegpt":
        raise InputError(
            f"--multiturn replays ShareGPT .json conversations; --dataset {args.dataset} is a {kind} "
            f"dataset (use --dataset multiturn for synthetic conversations)"
        )
    count_tokens, encode = approx_token_count, None
    if args.tokenizer:
        count_tokens, encode = load_tokenizer_counter(args.tokenizer)
    if args.prompt_ids and encode is None:
        raise InputError("--prompt-ids with a ShareGPT dataset needs --tokenizer to turn the text into ids")
    conversations = load_sharegpt_conversations(
        args.dataset, count_tokens, encode if args.prompt_ids else None, args.turns
    )
    conversations = [conversations[i] for i in rng.permutation(len(conversations))]
    if len(conversations) < args.num_prompts:
        logger.warning(
            f"{args.dataset} has {len(conversations)} usable conversations, fewer than --num-prompts "
            f"{args.num_prompts}: replaying {len(conversations)}"
        )
    conversations = conversations[: args.num_prompts]
    offsets, arrivals = schedule(len(conversations), None, args.request_rate, args.burstiness, args.time_scale, rng)
    arrivals += " (first turns; each later turn when the one before has finished)"
    return [
        dataclasses.replace(c, index=i, arrival_s=float(t)) for i, (c, t) in enumerate(zip(conversations, offsets))
    ], arrivals
