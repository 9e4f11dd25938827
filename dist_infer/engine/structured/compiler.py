"""Grammars for one model: its vocabulary as llguidance sees it, and each spec checked once.

llguidance matches bytes against the grammar, so it needs every token's bytes: it reads them from
the checkpoint's tokenizer.json (`TextTokenizer.backend`, a `tokenizers.Tokenizer`, GGUF-built
ones included). Its vocabulary is the model's (the LM head may be wider than the tokenizer: the
extra ids have no bytes, so no grammar allows them), and its EOS set is every id the engine stops
at, so EOS is allowed exactly where the grammar may end.

A spec is checked against that vocabulary when a request is made (a bad one is refused before it
is queued, with llguidance's message, for a 400), under limits on the grammar's size and the
parser's work per token, so a hostile schema costs bounded time. Checked grammars are kept in a
bounded LRU by spec key: a schema every request repeats is checked once, and on an instance built
into a matcher once (each request's state is a copy of it).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from loguru import logger

from dist_infer.engine.structured.counters import StructuredCounters
from dist_infer.engine.structured.matcher import RequestMatcher
from dist_infer.engine.structured.spec import StructuredSpec, StructuredSpecError

MAX_MESSAGE_CHARS = 500  # llguidance's messages quote the grammar; a client needs the first lines


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on one grammar: its size in symbols, the lexer's fuel to build it and per token, the
    parser's items per token (llguidance's LLParserLimits; its defaults but a smaller grammar)."""

    max_grammar_size: int = 200_000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000

    def parser_limits(self):
        """As llguidance's LLParserLimits; errors terse (a verbose one quotes the parser's state)."""
        from llguidance import LLParserLimits

        return LLParserLimits(
            max_grammar_size=self.max_grammar_size,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            verbose_errors=False,
        )


def ll_tokenizer(tokenizer: Any, n_vocab: int, eos_ids: Iterable[int]):
    """An llguidance LLTokenizer for `tokenizer` (a TextTokenizer: its `backend` is a
    tokenizers.Tokenizer) over `n_vocab` ids (the LM head's width, at least the tokenizer's), with
    `eos_ids` as its EOS set. Padding and truncation are dropped, as llguidance.hf does."""
    from llguidance import LLTokenizer

    backend = tokenizer.backend
    spec = json.loads(backend.to_str())
    spec["padding"], spec["truncation"] = None, None
    width = max(n_vocab, backend.get_vocab_size(with_added_tokens=True))
    return LLTokenizer(json.dumps(spec), n_vocab=width, eos_token=sorted(set(eos_ids)) or None)  # None: its own


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + " ..."


def compile_spec(spec: StructuredSpec, tokenizer, limits: GrammarLimits = GrammarLimits()) -> str:
    """The grammar of `spec`, checked against the LLTokenizer `tokenizer` within `limits`;
    StructuredSpecError with llguidance's message where it is not valid."""
    from llguidance import LLMatcher

    try:
        grammar = spec.to_grammar()
    except StructuredSpecError:
        raise
    except ValueError as exc:  # llguidance's, for a schema it cannot read
        raise StructuredSpecError(spec.kind, f"invalid {spec.kind}: {_short(str(exc))}") from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=limits.parser_limits())
    if is_error:
        raise StructuredSpecError(spec.kind, f"invalid {spec.kind}: {_short(messages[0] if messages else '')}")
    for message in messages:
        logger.debug(f"{spec.kind} grammar warning: {_short(message)}")
    return grammar


def validate(spec: StructuredSpec, tokenizer, limits: GrammarLimits = GrammarLimits()) -> None:
    """Raise StructuredSpecError (naming the spec's kind, with llguidance's message) unless `spec`
    is a grammar the LLTokenizer `tokenizer` can generate under `limits`."""
    compile_spec(spec, tokenizer, limits)


@dataclass
class _Compiled:
    """A checked grammar, and (on an engine, once a request needed it) its matcher at the start."""

    grammar: str
    start: Any = None  # llguidance's LLMatcher, never advanced: each request's state is a deep copy


class GrammarCompiler:
    """One engine's grammars (thread-safe: requests are checked on the callers' threads). The
    LLTokenizer is built on first use from `load_tokenizer()` (the checkpoint's TextTokenizer;
    None: this engine has none, and a structured request is refused); `vocab_size` and `eos_ids`
    are the model's. Up to `cache_size` checked grammars are kept, least recently used first out;
    the work is counted in `counters`."""

    def __init__(
        self,
        load_tokenizer: Optional[Callable[[], Any]],
        vocab_size: int,
        eos_ids: Iterable[int],
        limits: GrammarLimits = GrammarLimits(),
        cache_size: int = 256,
        counters: Optional[StructuredCounters] = None,
    ):
        self._load, self.vocab_size, self.eos_ids = load_tokenizer, vocab_size, frozenset(eos_ids)
        self.limits, self.cache_size = limits, cache_size
        self.counters = counters if counters is not None else StructuredCounters()
        self._lock = threading.Lock()
        self._tokenizer = None
        self._tokenizer_error: Optional[str] = None
        self._compiled: OrderedDict[str, _Compiled] = OrderedDict()

    def tokenizer(self):
        """The model's LLTokenizer, built once; StructuredSpecError if there is no tokenizer."""
        with self._lock:
            if self._tokenizer is None and self._tokenizer_error is None:
                self._tokenizer_error = "this engine was given no tokenizer" if self._load is None else None
                if self._load is not None:
                    try:
                        self._tokenizer = ll_tokenizer(self._load(), self.vocab_size, self.eos_ids)
                    except Exception as exc:  # noqa: BLE001 - no tokenizer.json, an unreadable one
                        self._tokenizer_error = f"the model's tokenizer cannot be loaded ({exc})"
                        logger.warning(f"structured outputs are off: {self._tokenizer_error}")
            if self._tokenizer is None:
                raise StructuredSpecError("structured", f"structured outputs need a tokenizer: {self._tokenizer_error}")
            return self._tokenizer

    def warm(self) -> None:
        """Build the LLTokenizer now, on a thread of its own (a server at start: the first
        structured request then does not pay for it); a failure is remembered as on first use."""

        def build() -> None:
            try:
                self.tokenizer()
            except StructuredSpecError:
                pass  # no tokenizer: a structured request says so

        if self._load is not None:
            threading.Thread(target=build, name="grammar-tokenizer", daemon=True).start()

    def _entry(self, spec: StructuredSpec) -> _Compiled:
        """`spec`'s cache entry (checked on a miss); StructuredSpecError if it is not valid."""
        key = spec.key()
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                self.counters.add(grammar_cache_hits=1)
                return self._compiled[key]
        start = time.perf_counter()
        # outside the lock: llguidance drops the GIL
        entry = _Compiled(compile_spec(spec, self.tokenizer(), self.limits))
        self.counters.add(grammar_compiles=1, grammar_compile_seconds=time.perf_counter() - start)
        with self._lock:
            entry = self._compiled.setdefault(key, entry)
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return entry

    def grammar(self, spec: StructuredSpec) -> str:
        """The checked grammar of `spec` (cached by its key); StructuredSpecError if it is not valid."""
        return self._entry(spec).grammar

    def validate(self, spec: StructuredSpec) -> None:
        """Raise StructuredSpecError unless this model can generate `spec`."""
        self._entry(spec)

    def matcher(self, spec: StructuredSpec, token_ids: Iterable[int] = ()) -> RequestMatcher:
        """A request's grammar state after `token_ids` (what it has generated so far): a copy of
        the spec's start state, built on the first request that needs it."""
        entry = self._entry(spec)
        if entry.start is None:
            begin = time.perf_counter()
            entry.start = RequestMatcher.start(self.tokenizer(), entry.grammar, self.limits.parser_limits()).llmatcher()
            self.counters.add(grammar_compile_seconds=time.perf_counter() - begin)
        self.counters.add(matchers_started=1)
        return RequestMatcher.resume(entry.start.deep_copy(), self.tokenizer().vocab_size, token_ids)
