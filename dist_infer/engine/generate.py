"""The generation loop: prefill a batch of prompts, then decode until EOS or the token limit.

With pipeline parallelism the batch is cut into microbatches that chase each other through
the stages: stage 0 sends microbatch 0, computes microbatch 1 while stage 1 works on 0, and
so on; the last stage samples and sends the tokens back to stage 0, which starts that
microbatch's next step. Every stage is busy during prefill and decode, not only one at a time.
Messages carry a small header (which sequences, how many new tokens each) so each stage keeps
its own KV bookkeeping without any other coordination.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from dist_infer.comm.base import Communicator, Handle
from dist_infer.comm.groups import ParallelGroups
from dist_infer.engine.allocator import tune_malloc
from dist_infer.engine.kv_cache import PagedKVCache, blocks_for
from dist_infer.engine.sampling import SamplingParams, sample, sequence_generator
from dist_infer.models.attention import build_attention_metadata, split_token_halves
from dist_infer.models.cp_attention import (
    CP_VARIANTS,
    ContextParallelError,
    cp_decode_metadata,
    cp_decode_owner,
    cp_prefill_metadata,
)
from dist_infer.models.llama import LlamaStage
from dist_infer.parallel.ring_attention import zigzag_chunks
from dist_infer.parallel.sequence_parallel import should_sequence_parallel
from dist_infer.parallel.token_split import should_split

TAG_FORWARD, TAG_BACK = 1, 2
# Tokens per step from which `--overlap auto` splits, per device kind: on the 2-core CPU machine
# splitting gains nothing at 1024 tokens and 2.5% at 2048 (docs/benchmarks.md); TokenWeave
# finds about 1024 on H100s.
OVERLAP_THRESHOLDS = {"cpu": 2048, "cuda": 1024}
DEFAULT_OVERLAP_THRESHOLD = OVERLAP_THRESHOLDS["cuda" if torch.cuda.is_available() else "cpu"]
# Tokens per step from which `--sequence-parallel auto` applies; None: auto never does. On the
# 2-core CPU machine it was within noise of plain tp at 1024 and 2048 tokens and slower in
# decode (docs/benchmarks.md); on CUDA it is unmeasured (no GPU yet), so auto leaves it off.
SEQUENCE_PARALLEL_THRESHOLDS = {"cpu": None, "cuda": None}
DEFAULT_SEQUENCE_PARALLEL_THRESHOLD = SEQUENCE_PARALLEL_THRESHOLDS["cuda" if torch.cuda.is_available() else "cpu"]
KIND_STOP, KIND_WORK = 0, 1


class PromptError(ValueError):
    """A prompt the model cannot take (empty, too long, ids outside the vocabulary)."""


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: Optional[str] = None
    logits: list[torch.Tensor] = field(default_factory=list)  # per step, when asked for


@dataclass
class Timing:
    ttft_s: float = 0.0
    prefill_tokens: int = 0
    sequences: int = 1
    decode_tokens: int = 0
    decode_s: float = 0.0
    ttft_cpu_s: float = 0.0  # CPU time of this process (all its threads) for the prefill: load-independent cost

    def as_dict(self) -> dict:
        return {
            "ttft_s": self.ttft_s,
            "prefill_tok_s": self.prefill_tokens / self.ttft_s if self.ttft_s else 0.0,
            "decode_tok_s": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
            # time per output token of one sequence, i.e. per decode step of the batch (the peers' definition)
            "tpot_s": self.decode_s * self.sequences / self.decode_tokens if self.decode_tokens else 0.0,
            "ttft_cpu_s": self.ttft_cpu_s,
        }


class Engine:
    """Runs one rank's pipeline stage inside the generation loop."""

    def __init__(self, stage: LlamaStage, groups: ParallelGroups, block_size: int = 16,
                 overlap: str = "off", overlap_threshold: int = DEFAULT_OVERLAP_THRESHOLD, cp_variant: str = "auto",
                 sequence_parallel: str = "off",
                 sequence_parallel_threshold: Optional[int] = DEFAULT_SEQUENCE_PARALLEL_THRESHOLD):
        self.stage, self.groups, self.block_size = stage, groups, block_size
        tune_malloc()
        self._init_cp(groups.cp, cp_variant)
        should_split(overlap, 0, 1, overlap_threshold)  # validates the mode
        should_sequence_parallel(sequence_parallel, 0, 1, sequence_parallel_threshold)
        self.overlap, self.overlap_threshold = overlap, overlap_threshold
        self.sequence_parallel, self.sequence_parallel_threshold = sequence_parallel, sequence_parallel_threshold
        self.pp: Communicator = groups.pp
        self.cfg = stage.cfg
        self.timing = Timing()
        self._pending: list[Handle] = []

    # -- validation ---------------------------------------------------------------------------
    def check_prompts(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if not prompts:
            raise PromptError("no prompts given")
        for i, p in enumerate(prompts):
            if not p:
                raise PromptError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise PromptError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary of {self.cfg.vocab_size}")
            if len(p) + params.max_new_tokens > self.cfg.max_positions:
                raise PromptError(
                    f"prompt {i} has {len(p)} tokens + {params.max_new_tokens} new tokens = "
                    f"{len(p) + params.max_new_tokens}, more than the model's {self.cfg.max_positions} positions"
                )

    # -- one forward step of this stage -------------------------------------------------------
    def _cache(self, prompts: list[list[int]], params: SamplingParams) -> PagedKVCache:
        blocks = sum(blocks_for(self._tokens_kept(len(p), params.max_new_tokens), self.block_size) for p in prompts)
        kv_heads = max(1, self.stage.kv_heads_local)
        return PagedKVCache(len(self.stage.layers), blocks, self.block_size, kv_heads, self.cfg.head_dim,
                            self.stage.dtype)

    def _forward(self, cache: PagedKVCache, seq_ids: list[int], q_lens: list[int], inputs: torch.Tensor) -> torch.Tensor:
        if self.cp.size > 1:
            return self._forward_cp(cache, seq_ids, q_lens, inputs)
        tables = [cache.reserve(s, q) for s, q in zip(seq_ids, q_lens)]
        seq_lens = [cache.lengths[s] + q for s, q in zip(seq_ids, q_lens)]
        if should_split(self.overlap, sum(q_lens), self.groups.tp.size, self.overlap_threshold):
            meta = split_token_halves(q_lens, seq_lens, tables, self.block_size, self.cfg.sliding_window)
        else:
            meta = build_attention_metadata(q_lens, seq_lens, tables, self.block_size, self.cfg.sliding_window)
            meta.sequence_parallel = should_sequence_parallel(self.sequence_parallel, sum(q_lens), self.groups.tp.size,
                                                              self.sequence_parallel_threshold)
        with torch.inference_mode():
            out = self.stage(inputs, meta, cache.layers)
        for s, q in zip(seq_ids, q_lens):
            cache.advance(s, q)
        return out

    # -- context parallelism: the sequences sharded over the cp group ----------------------------
    def _init_cp(self, cp: Communicator, variant: str) -> None:
        if variant not in CP_VARIANTS:
            raise ContextParallelError(f"cp variant {variant!r} is not one of {CP_VARIANTS}")
        self.cp, self.cp_variant = cp, variant
        self._cp_prompt_len: dict[int, int] = {}  # sequence -> prompt length
        self._cp_len: dict[int, int] = {}  # sequence -> tokens so far, all cp ranks together
        if cp.size > 1 and self.groups.pp.size > 1:
            raise ContextParallelError(f"cp with pp is not supported yet (cp={cp.size}, pp={self.groups.pp.size})")
        if cp.size > 1 and getattr(self.stage, "cp", None) is None:
            raise ContextParallelError(f"cp={cp.size}: {type(self.stage).__name__} has no context-parallel attention")

    def _tokens_kept(self, prompt_len: int, new_tokens: int) -> int:
        """KV-cache rows one sequence needs on this rank: all of it, or its cp share."""
        if self.cp.size == 1:
            return prompt_len + new_tokens
        n = self.cp.size
        return zigzag_chunks(prompt_len, n, self.cp.rank).num_rows + -(-new_tokens // n)

    def _forward_cp(self, cache: PagedKVCache, seq_ids: list[int], q_lens: list[int], inputs: torch.Tensor) -> torch.Tensor:
        """This rank's part of a step: a prefill on its zigzag share of the prompts, or a decode
        token run on every cp rank and stored on one (round-robin)."""
        n, me = self.cp.size, self.cp.rank
        if all(s not in self._cp_len for s in seq_ids):
            local = [zigzag_chunks(q, n, me).num_rows for q in q_lens]
            tables = [cache.reserve(s, m) for s, m in zip(seq_ids, local)]
            attn = self.stage.layers[0].self_attn if len(self.stage.layers) else None
            meta, mine = cp_prefill_metadata(q_lens, n, me, tables, self.block_size, self.cp_variant,
                                             attn.q_heads if attn else 1, attn.kv_heads if attn else 1,
                                             self.cfg.sliding_window, next(self.stage.parameters()).device.type,
                                             torch.empty((), dtype=self.stage.dtype).element_size())
            starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
            inputs = inputs[torch.tensor([st + p for st, pos in zip(starts, mine) for p in pos], dtype=torch.long)]
            for s, q in zip(seq_ids, q_lens):
                self._cp_prompt_len[s] = self._cp_len[s] = q
            added = local
        elif all(q == 1 for q in q_lens) and all(s in self._cp_len for s in seq_ids):
            positions = [self._cp_len[s] for s in seq_ids]
            store = [cp_decode_owner(p, self._cp_prompt_len[s], n) == me for p, s in zip(positions, seq_ids)]
            added = [int(x) for x in store]
            tables = [cache.reserve(s, a) for s, a in zip(seq_ids, added)]
            local_lens = [cache.lengths[s] + a for s, a in zip(seq_ids, added)]
            meta = cp_decode_metadata(positions, store, local_lens, tables, self.block_size)
            for s in seq_ids:
                self._cp_len[s] += 1
        else:
            raise ContextParallelError(
                f"a cp step is a prefill of fresh prompts or one new token per cached sequence; got sequences "
                f"{seq_ids} with {q_lens} new tokens (prefill on top of cached context is not supported yet)")
        with torch.inference_mode():
            out = self.stage(inputs, meta, cache.layers)
        for s, a in zip(seq_ids, added):
            cache.advance(s, a)
        return out

    def _agree_across_cp(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cp rank computed the same logits; still take cp rank 0's tokens so the ranks can never drift apart."""
        packed = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)])  # ids < 2**53 are exact
        self.cp.broadcast(packed, 0)
        return packed[0].to(tokens.dtype), packed[1].to(logprobs.dtype)

    # -- messages between stages ----------------------------------------------------------------
    def _header(self, kind: int, seq_ids: list[int], q_lens: list[int], width: int) -> torch.Tensor:
        h = torch.zeros(3 + 2 * width, dtype=torch.long)
        h[0], h[1], h[2] = kind, len(seq_ids), sum(q_lens)
        h[3:3 + len(seq_ids)] = torch.tensor(seq_ids, dtype=torch.long)
        h[3 + width:3 + width + len(q_lens)] = torch.tensor(q_lens, dtype=torch.long)
        return h

    @staticmethod
    def _parse(h: torch.Tensor, width: int) -> tuple[int, list[int], list[int]]:
        n = int(h[1])
        return int(h[0]), h[3:3 + n].tolist(), h[3 + width:3 + width + n].tolist()

    def _post(self, tensors: list[torch.Tensor], dst: int, tag: int) -> None:
        for t in tensors:
            self._pending.append(self.pp.isend(t.contiguous(), dst, tag))
        self._pending = [h for h in self._pending if not h.is_completed()]

    def _drain(self) -> None:
        for h in self._pending:
            h.wait()
        self._pending = []

    # -- the loop -------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams = SamplingParams(),
                 return_logits: bool = False) -> list[GenerationOutput]:
        """Generate for `prompts`. Complete outputs on pipeline stage 0 (world rank 0 among them)."""
        self.check_prompts(prompts, params)
        self.timing = Timing(prefill_tokens=sum(len(p) for p in prompts), sequences=len(prompts))
        cache = self._cache(prompts, params)
        self._cp_prompt_len, self._cp_len = {}, {}
        if self.pp.size == 1:
            return self._generate_single_stage(cache, prompts, params, return_logits)
        if self.pp.rank == 0:
            outputs = self._first_stage(cache, prompts, params, return_logits)
        else:
            outputs = self._later_stage(cache, prompts, params, return_logits)
        self._drain()
        return outputs

    def _finished(self, out: GenerationOutput, params: SamplingParams) -> bool:
        if out.finish_reason:
            return True
        if params.stop_at_eos and out.token_ids and out.token_ids[-1] in self.cfg.eos_token_ids:
            out.finish_reason = "eos"
        elif len(out.token_ids) >= params.max_new_tokens:
            out.finish_reason = "length"
        return out.finish_reason is not None

    def _record(self, outputs, seq_ids, tokens, logprobs, logits=None) -> None:
        for i, s in enumerate(seq_ids):
            outputs[s].token_ids.append(int(tokens[i]))
            outputs[s].logprobs.append(float(logprobs[i]))
            if logits is not None:
                outputs[s].logits.append(logits[i].clone())

    def _generate_single_stage(self, cache, prompts, params, return_logits):
        outputs = [GenerationOutput(list(p)) for p in prompts]
        gens = [sequence_generator(params.seed, i) for i in range(len(prompts))]
        active = list(range(len(prompts)))
        q_lens = [len(p) for p in prompts]
        inputs = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        start, cpu_start = time.perf_counter(), time.process_time()
        step = 0
        while active:
            logits = self._forward(cache, active, q_lens, inputs)
            tokens, logprobs = sample(logits, params, [gens[s] for s in active])
            if self.cp.size > 1:
                tokens, logprobs = self._agree_across_cp(tokens, logprobs)
            self._record(outputs, active, tokens, logprobs, logits if return_logits else None)
            now = time.perf_counter()
            if step == 0:
                self.timing.ttft_s = now - start
                self.timing.ttft_cpu_s = time.process_time() - cpu_start
                decode_start = now
            else:
                self.timing.decode_tokens += len(active)
                self.timing.decode_s = now - decode_start
            step += 1
            keep = [i for i, s in enumerate(active) if not self._finished(outputs[s], params)]
            for i, s in enumerate(active):
                if i not in keep:
                    cache.free(s)
            active = [active[i] for i in keep]
            inputs = tokens[keep]
            q_lens = [1] * len(active)
        return outputs

    def _microbatches(self, n: int) -> list[list[int]]:
        m = min(self.pp.size, n)
        bounds = [round(i * n / m) for i in range(m + 1)]
        return [list(range(bounds[i], bounds[i + 1])) for i in range(m)]

    def _first_stage(self, cache, prompts, params, return_logits):
        width, last = len(prompts), self.pp.size - 1
        outputs = [GenerationOutput(list(p)) for p in prompts]
        start = time.perf_counter()
        queue = deque()
        for mb in self._microbatches(len(prompts)):
            q_lens = [len(prompts[s]) for s in mb]
            inputs = torch.tensor([t for s in mb for t in prompts[s]], dtype=torch.long)
            hidden = self._forward(cache, mb, q_lens, inputs)
            self._post([self._header(KIND_WORK, mb, q_lens, width), hidden], 1, TAG_FORWARD)
            queue.append(mb)
        first_tokens_seen = 0
        decode_start = None
        vocab = self.cfg.vocab_size
        while queue:
            mb = queue.popleft()
            header = torch.empty(3 + 2 * width, dtype=torch.long)
            self.pp.recv(header, last, TAG_BACK)
            _, seq_ids, _ = self._parse(header, width)
            if seq_ids != mb:
                raise RuntimeError(f"pipeline out of order: expected sequences {mb}, got {seq_ids}")
            tokens = torch.empty(len(mb), dtype=torch.long)
            logprobs = torch.empty(len(mb), dtype=torch.float64)
            self.pp.recv(tokens, last, TAG_BACK)
            self.pp.recv(logprobs, last, TAG_BACK)
            logits = None
            if return_logits:
                logits = torch.empty(len(mb), vocab, dtype=torch.float32)
                self.pp.recv(logits, last, TAG_BACK)
            self._record(outputs, mb, tokens, logprobs, logits)
            now = time.perf_counter()
            if first_tokens_seen < len(prompts):
                first_tokens_seen += len(mb)
                if first_tokens_seen == len(prompts):
                    self.timing.ttft_s = now - start
                    decode_start = now
            else:
                self.timing.decode_tokens += len(mb)
                self.timing.decode_s = now - decode_start
            active = [s for s in mb if not self._finished(outputs[s], params)]
            for s in mb:
                if s not in active:
                    cache.free(s)
            if not active:
                continue
            inputs = torch.tensor([outputs[s].token_ids[-1] for s in active], dtype=torch.long)
            hidden = self._forward(cache, active, [1] * len(active), inputs)
            self._post([self._header(KIND_WORK, active, [1] * len(active), width), hidden], 1, TAG_FORWARD)
            queue.append(active)
        self._post([self._header(KIND_STOP, [], [], width)], 1, TAG_FORWARD)
        return outputs

    def _later_stage(self, cache, prompts, params, return_logits):
        width, me, last = len(prompts), self.pp.rank, self.pp.size - 1
        outputs = [GenerationOutput(list(p)) for p in prompts]
        gens = [sequence_generator(params.seed, i) for i in range(len(prompts))]
        H = self.cfg.hidden_size
        while True:
            header = torch.empty(3 + 2 * width, dtype=torch.long)
            self.pp.recv(header, me - 1, TAG_FORWARD)
            kind, seq_ids, q_lens = self._parse(header, width)
            if kind == KIND_STOP:
                if me != last:
                    self._post([header], me + 1, TAG_FORWARD)
                return outputs
            hidden = torch.empty(sum(q_lens), H, dtype=self.stage.dtype)
            self.pp.recv(hidden, me - 1, TAG_FORWARD)
            out = self._forward(cache, seq_ids, q_lens, hidden)
            if me != last:
                self._post([header, out], me + 1, TAG_FORWARD)
                continue
            tokens, logprobs = sample(out, params, [gens[s] for s in seq_ids])
            self._record(outputs, seq_ids, tokens, logprobs)
            msg = [self._header(KIND_WORK, seq_ids, q_lens, width), tokens, logprobs.double()]
            if return_logits:
                msg.append(out.float())
            self._post(msg, 0, TAG_BACK)
