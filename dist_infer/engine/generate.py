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
from loguru import logger

from dist_infer.comm.base import Communicator, Handle
from dist_infer.comm.groups import ParallelGroups
from dist_infer.engine.kv_cache import PagedKVCache, blocks_for
from dist_infer.engine.sampling import SamplingParams, sample, sequence_generator
from dist_infer.models.attention import build_attention_metadata, split_token_halves
from dist_infer.models.llama import LlamaStage
from dist_infer.parallel.token_split import should_split

TAG_FORWARD, TAG_BACK = 1, 2
# Tokens per step from which `--overlap auto` splits (measured on the 2-core CPU machine, see
# docs/benchmarks.md; TokenWeave finds about 1024 on H100s).
DEFAULT_OVERLAP_THRESHOLD = 1024
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
    decode_tokens: int = 0
    decode_s: float = 0.0

    def as_dict(self) -> dict:
        return {
            "ttft_s": self.ttft_s,
            "prefill_tok_s": self.prefill_tokens / self.ttft_s if self.ttft_s else 0.0,
            "decode_tok_s": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
            "tpot_s": self.decode_s / max(1, self.decode_tokens) if self.decode_tokens else 0.0,
        }


class Engine:
    """Runs one rank's pipeline stage inside the generation loop."""

    def __init__(self, stage: LlamaStage, groups: ParallelGroups, block_size: int = 16,
                 overlap: str = "off", overlap_threshold: int = DEFAULT_OVERLAP_THRESHOLD):
        self.stage, self.groups, self.block_size = stage, groups, block_size
        should_split(overlap, 0, 1, overlap_threshold)  # validates the mode
        self.overlap, self.overlap_threshold = overlap, overlap_threshold
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
        blocks = sum(blocks_for(len(p) + params.max_new_tokens, self.block_size) for p in prompts)
        kv_heads = max(1, self.stage.kv_heads_local)
        return PagedKVCache(len(self.stage.layers), blocks, self.block_size, kv_heads, self.cfg.head_dim,
                            self.stage.dtype)

    def _forward(self, cache: PagedKVCache, seq_ids: list[int], q_lens: list[int], inputs: torch.Tensor) -> torch.Tensor:
        tables = [cache.reserve(s, q) for s, q in zip(seq_ids, q_lens)]
        seq_lens = [cache.lengths[s] + q for s, q in zip(seq_ids, q_lens)]
        if should_split(self.overlap, sum(q_lens), self.groups.tp.size, self.overlap_threshold):
            meta = split_token_halves(q_lens, seq_lens, tables, self.block_size, self.cfg.sliding_window)
        else:
            meta = build_attention_metadata(q_lens, seq_lens, tables, self.block_size, self.cfg.sliding_window)
        with torch.inference_mode():
            out = self.stage(inputs, meta, cache.layers)
        for s, q in zip(seq_ids, q_lens):
            cache.advance(s, q)
        return out

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
        self.timing = Timing(prefill_tokens=sum(len(p) for p in prompts))
        cache = self._cache(prompts, params)
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
        start = time.perf_counter()
        step = 0
        while active:
            logits = self._forward(cache, active, q_lens, inputs)
            tokens, logprobs = sample(logits, params, [gens[s] for s in active])
            self._record(outputs, active, tokens, logprobs, logits if return_logits else None)
            now = time.perf_counter()
            if step == 0:
                self.timing.ttft_s = now - start
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
