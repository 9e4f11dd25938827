"""Multi-turn replay: each conversation's turns are sent one after another, turn k+1 only when
turn k has finished, and each with the whole conversation so far, the server's own answers
included, the way a chat client resends its history. A prefix cache should make a later turn's
TTFT close to the first turn's, so the summary has the median TTFT of every turn index.

Three forms of the conversation so far, by endpoint: chat messages (`--endpoint chat`), one text
(completions), or token ids (`--prompt-ids`: the answer's ids as the server returns them, asked
for with vLLM's `return_token_ids`; this project's server always sends them). Text completions
append the answer's text, which the server may tokenize differently from the ids it generated, so
the cache can miss the last block or so of each answer.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
from loguru import logger

from dist_infer.bench.serve.client import Answer, RequestRecord, Session, request_payload, send_request
from dist_infer.bench.serve.conversations import Conversation, UserTurn
from dist_infer.bench.serve.datasets import BenchRequest

TEXT_SEPARATOR = "\n\n"  # text completions: between an answer (or the system prompt) and the next user message


class Transcript:
    """One conversation so far, in the form its endpoint takes, and its length in prompt tokens."""

    def __init__(
        self,
        conversation: Conversation,
        endpoint: str,
        prompt_ids: bool,
        encode: Optional[Callable[[str], list[int]]] = None,
    ):
        self.mode = "chat" if endpoint == "chat" else "ids" if prompt_ids else "text"
        self.encode = encode  # --tokenizer: ids for an answer that came without them
        self.tokens = conversation.system_len  # exact for ids; else estimated, corrected by the server's usage
        system = conversation.system
        self.prompt: Union[str, list[int], list[dict]]
        if self.mode == "chat":
            self.prompt = [{"role": "system", "content": system}] if system else []
        elif self.mode == "ids":
            self.prompt = list(system or [])
        else:
            self.prompt = system or ""

    def ask(self, turn: UserTurn) -> Union[str, list[int], list[dict]]:
        """The prompt of this turn: the conversation so far and the new user message."""
        if self.mode == "chat":
            self.prompt = self.prompt + [{"role": "user", "content": turn.message}]
        elif self.mode == "ids":
            self.prompt = self.prompt + list(turn.message)
        else:
            self.prompt = self.prompt + TEXT_SEPARATOR + turn.message if self.prompt else turn.message
        self.tokens += turn.message_len
        return self.prompt

    def answered(self, answer: Answer, record: RequestRecord) -> Optional[str]:
        """Append the server's answer; a reason the conversation cannot go on, or None."""
        if record.prompt_tokens is not None:
            self.tokens = record.prompt_tokens
        self.tokens += record.output_tokens
        if self.mode == "chat":
            self.prompt = self.prompt + [{"role": "assistant", "content": answer.text}]
        elif self.mode == "text":
            self.prompt = self.prompt + answer.text
        elif answer.ids_complete:
            self.prompt = self.prompt + answer.token_ids
        elif self.encode is not None:
            self.prompt = self.prompt + self.encode(answer.text)
        else:
            return (
                "the server streamed text without token_ids, so the answer cannot be appended as ids; "
                "pass --tokenizer to encode its text, or leave out --prompt-ids"
            )
        return None


async def run_conversation(
    session: Session,
    conversation: Conversation,
    endpoint: str,
    ignore_eos: bool,
    prompt_ids: bool,
    max_input_len: Optional[int],
    numbers: Iterator[int],
    progress: Optional[Callable[[RequestRecord], None]] = None,
    encode: Optional[Callable[[str], list[int]]] = None,
) -> list[RequestRecord]:
    """Send one conversation's turns in order from its arrival time; stops early at a failed turn
    (there is no answer to go on from) or before a prompt longer than max_input_len."""
    delay = conversation.arrival_s - session.now()
    if delay > 0:
        await asyncio.sleep(delay)
    transcript = Transcript(conversation, endpoint, prompt_ids, encode)
    records: list[RequestRecord] = []
    for number, turn in enumerate(conversation.turns, start=1):
        prompt = transcript.ask(turn)
        if max_input_len and number > 1 and transcript.tokens > max_input_len:
            logger.debug(
                f"conversation {conversation.index} ends before turn {number}: {transcript.tokens} "
                f"prompt tokens > --max-input-len {max_input_len}"
            )
            break
        request = BenchRequest(next(numbers), prompt, transcript.tokens, turn.output_len, session.now())
        payload = request_payload(request, session.model, endpoint, ignore_eos)
        if transcript.mode == "ids":
            payload["return_token_ids"] = True  # vLLM sends the answer's ids only when asked
        record = RequestRecord(
            request.index, request.input_len, request.output_len, conversation=conversation.index, turn=number
        )
        answer = Answer()
        await send_request(session, payload, record, answer)
        records.append(record)
        if progress is not None:
            progress(record)
        if not record.success:
            break
        why = transcript.answered(answer, record)
        if why is not None:
            logger.warning(f"conversation {conversation.index} ends after turn {number}: {why}")
            break
    return records


async def run_conversations(
    session: Session,
    conversations: Sequence[Conversation],
    endpoint: str,
    ignore_eos: bool,
    prompt_ids: bool,
    max_input_len: Optional[int] = None,
    progress: Optional[Callable[[RequestRecord], None]] = None,
    encode: Optional[Callable[[str], list[int]]] = None,
) -> list[RequestRecord]:
    """Every conversation concurrently, each from its arrival time (relative to session.start);
    --max-concurrency (session.slots) caps the requests in flight, not the conversations. The
    records in conversation order, turns in order; their indexes are unique, in order of sending."""
    numbers = itertools.count()
    done = await asyncio.gather(
        *(
            run_conversation(
                session, conversation, endpoint, ignore_eos, prompt_ids, max_input_len, numbers, progress, encode
            )
            for conversation in conversations
        )
    )
    return [record for records in done for record in records]


def ttft_by_turn(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The summary's per-turn entries: median TTFT (ms) and completed requests of each turn index
    (keys "1".."N", strings so the JSON reads the same), over the successful requests."""
    turns = max((r.turn for r in records if r.turn is not None), default=0)
    medians: dict[str, Optional[float]] = {}
    completed: dict[str, int] = {}
    for turn in range(1, turns + 1):
        ttfts = [r.ttft for r in records if r.turn == turn and r.success and r.ttft is not None]
        medians[str(turn)] = float(np.median(ttfts)) * 1000.0 if ttfts else None
        completed[str(turn)] = sum(1 for r in records if r.turn == turn and r.success)
    return {"ttft_ms_by_turn": medians, "completed_by_turn": completed}


def turn_report_lines(summary: dict[str, Any]) -> list[str]:
    """The table's per-turn rows: requests completed, median TTFT, and its ratio to turn 1's."""
    medians = summary.get("ttft_ms_by_turn") or {}
    if not medians:
        return []
    first = medians.get("1")
    lines = [f"{'turn':<14}{'completed':>12}{'TTFT median':>14}{'vs turn 1':>12}"]
    for turn, median in medians.items():
        ratio = f"{median / first:.2f}x" if median is not None and first else "-"
        value = "-" if median is None else f"{median:.2f}"
        lines.append(f"{turn:<14}{summary['completed_by_turn'].get(turn, 0):>12}{value:>14}{ratio:>12}")
    lines.append(
        "(TTFT median in ms of each turn index over all conversations; each turn sends the whole conversation so far)"
    )
    return lines
