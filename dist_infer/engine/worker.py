"""One rank's share of a step: turn the step plan into attention metadata and run the stage.

Every rank of an instance runs the same plans in the same order, so the KV cache needs no
bookkeeping of its own: keys and values go where the plan's block tables say. Context-parallel
ranks are the exception: each holds its zigzag share of a prompt and a round-robin share of
the decode tokens, so each keeps its own block tables (from the plan's sequence ids and token
counts), and frees them when the plan lists the sequence as freed.

The metadata is built on the host from the plan's lists and moved to the model's device once per
step (`_on_device`, through engine/device_io.py); on a CPU model it stays as built.
"""

from __future__ import annotations

from typing import Optional

import torch
from loguru import logger

from dist_infer.comm.groups import ParallelGroups
from dist_infer.engine.decode_graphs import DecodeGraphs, GraphCaptureError, StaticDecodeStep, graphs_wanted
from dist_infer.engine.device_io import host_index, module_device, to_device
from dist_infer.engine.kv_cache import PagedKVCache
from dist_infer.engine.step_plan import StepPlan
from dist_infer.models.attention_metadata import build_attention_metadata, split_token_halves
from dist_infer.models.cp_attention import (
    ContextParallelError,
    cp_decode_metadata,
    cp_decode_owner,
    cp_prefill_metadata,
)
from dist_infer.models.layered import LayeredStep, LayeredStepError, check_layered
from dist_infer.parallel.ring.shards import zigzag_chunks
from dist_infer.parallel.sequence_parallel import should_sequence_parallel
from dist_infer.parallel.token_split import should_split


class StageWorker:
    def __init__(
        self,
        stage,
        groups: ParallelGroups,
        cache: PagedKVCache,
        block_size: int,
        overlap: str,
        overlap_threshold: int,
        sequence_parallel: str,
        sequence_parallel_threshold: Optional[int],
        cp_variant: str,
        cuda_graphs: str = "off",
        max_rows: int = 256,
    ):
        """`cuda_graphs`: engine/decode_graphs.py's modes; `max_rows`: the most sequences a step holds
        (the largest bucket). The cache needs a scratch block where graphs are wanted."""
        self.stage, self.groups, self.cache, self.block_size = stage, groups, cache, block_size
        self.cfg = stage.cfg
        self.device = module_device(stage)  # every tensor of a step goes here (engine/device_io.py)
        self.overlap, self.overlap_threshold = overlap, overlap_threshold
        self.sequence_parallel, self.sequence_parallel_threshold = sequence_parallel, sequence_parallel_threshold
        self.cp, self.cp_variant = groups.cp, cp_variant
        self._cp_prompt_len: dict[int, int] = {}  # sequence -> prompt length it was prefilled with
        self._cp_len: dict[int, int] = {}  # sequence -> tokens so far, all cp ranks together
        self._layered_hidden: dict[int, torch.Tensor] = {}  # layered prefill: sequence -> hidden states between groups
        self.graphs: Optional[DecodeGraphs] = self._decode_graphs(cuda_graphs, max_rows)

    def _decode_graphs(self, mode: str, max_rows: int) -> Optional[DecodeGraphs]:
        """The bucketed decode steps, captured where `mode` and the stage allow (else None: eager)."""
        if not graphs_wanted(mode, self.device) or self.cp.size > 1:
            return None
        if mode == "auto" and (self.groups.tp.size > 1 or self.groups.pp.size > 1):
            logger.info(
                "CUDA graphs off under tp or pp > 1 with --cuda-graphs auto (unverified on several GPUs: "
                "the tp all-reduces inside the graph, the stages' hidden states into it): --cuda-graphs on "
                "captures them"
            )
            return None
        if self.cache.scratch_block is None:
            raise GraphCaptureError("bucketed decode steps need a KV cache with a scratch block")
        stage, cache, cfg = self.stage, self.cache, self.cfg
        width = -(-cfg.max_positions // self.block_size)
        graphs = DecodeGraphs(
            lambda inputs, meta: stage(inputs, meta, cache.layers),
            stage.first,
            stage.input_width,
            stage.dtype,
            max_rows,
            width,
            self.block_size,
            cache.scratch_block * self.block_size,
            cfg.sliding_window,
            self.device,
            capture=mode != "padded",
        )
        try:
            graphs.capture()
        except Exception as exc:  # noqa: BLE001 - auto falls back, by name
            graphs.drop()
            if mode == "on":
                raise GraphCaptureError(f"capturing the decode step failed: {exc!r}") from exc
            logger.warning(f"CUDA graphs off: capturing the decode step failed ({exc!r}); decode steps run eagerly")
            return None
        return graphs

    def forget(self, seq_ids: list[int]) -> None:
        """Sequences that finished or were preempted: drop this rank's own bookkeeping of them."""
        for s in seq_ids:
            self._layered_hidden.pop(s, None)
        if self.cp.size == 1:
            return
        for s in seq_ids:
            self.cache.free(s)
            self._cp_prompt_len.pop(s, None)
            self._cp_len.pop(s, None)

    def prepare(self, plan: StepPlan) -> Optional[object]:
        """Check the plan and build its attention metadata, with no collective and no side effect:
        the driver calls it before the plan leaves, so a plan that raises here (as it would on
        every rank) fails its requests instead of stopping some ranks mid-step. cp: only the check."""
        if self.cp.size > 1:
            if plan.speculative:
                raise ContextParallelError("speculative decoding is not supported with context parallel")
            self._cp_kind(plan)
            return None
        q_lens, seq_lens = plan.num_tokens, plan.seq_lens
        if plan.layered:
            if plan.speculative:
                raise LayeredStepError("a layered prefill step cannot verify speculative proposals")
            return self._on_device(self._layered_step(plan))
        split = should_split(self.overlap, plan.total_tokens, self.groups.tp.size, self.overlap_threshold)
        if (
            self.graphs is not None
            and not split
            and all(q == 1 for q in q_lens)
            and not should_sequence_parallel(
                self.sequence_parallel, plan.total_tokens, self.groups.tp.size, self.sequence_parallel_threshold
            )
        ):
            static = self.graphs.prepare(plan.input_ids, plan.starts, plan.block_tables)
            if static is not None:
                return static
        counts = plan.logit_counts if plan.speculative else None
        window = self.cfg.sliding_window
        if split:
            split = split_token_halves(
                q_lens, seq_lens, plan.block_tables, self.block_size, window, logit_counts=counts
            )
            return self._on_device(split)
        meta = build_attention_metadata(
            q_lens, seq_lens, plan.block_tables, self.block_size, window, counts, plan.prompt_tokens
        )
        meta.sequence_parallel = should_sequence_parallel(
            self.sequence_parallel, plan.total_tokens, self.groups.tp.size, self.sequence_parallel_threshold
        )
        return self._on_device(meta)

    def token_inputs(self, plan: StepPlan, meta: Optional[object]) -> Optional[torch.Tensor]:
        """The first stage's token ids on the device: already in a bucketed step's buffers (None),
        else copied from the plan."""
        return None if isinstance(meta, StaticDecodeStep) else host_index(plan.input_ids, self.device)

    def _layered_step(self, plan: StepPlan) -> LayeredStep:
        """The metadata of a step with a prompt in the middle of its layers (models/layered.py):
        the whole step's, and the others' for the layers it does not run."""
        if len(plan.layered) != 1 or self.groups.pp.size > 1:
            raise LayeredStepError(
                f"a step runs one layered prompt on a whole model (pp=1); got {len(plan.layered)} "
                f"with pp={self.groups.pp.size}"
            )
        ((index, first, end),) = plan.layered
        q_lens, seq_lens, tables = plan.num_tokens, plan.seq_lens, plan.block_tables
        window = self.cfg.sliding_window
        full = build_attention_metadata(q_lens, seq_lens, tables, self.block_size, window)
        a = sum(q_lens[:index])
        keep = [i for i in range(len(q_lens)) if i != index]
        others = other_rows = None
        if keep:
            others = build_attention_metadata(
                [q_lens[i] for i in keep],
                [seq_lens[i] for i in keep],
                [tables[i] for i in keep],
                self.block_size,
                window,
            )
            other_rows = torch.cat([torch.arange(a), torch.arange(a + q_lens[index], plan.total_tokens)])
        step = LayeredStep(
            full,
            others,
            other_rows,
            (a, a + q_lens[index]),
            index,
            plan.seq_ids[index],
            first,
            end,
            self._layered_hidden,
        )
        check_layered(step, len(self.stage.layers))
        return step

    def _on_device(self, meta):
        """The step's metadata, built on the host, moved to the model's device once (CPU: as it is)."""
        if self.device.type == "cpu":
            return meta
        return meta.moved(lambda t: to_device(t, self.device))

    def execute(self, plan: StepPlan, inputs: torch.Tensor, meta: Optional[object] = None) -> torch.Tensor:
        """Run the stage on `inputs` (token ids on the first stage, hidden states after it);
        `meta`: what `prepare` built for this plan, if it was called already."""
        if self.cp.size > 1:
            return self._execute_cp(plan, inputs)
        if meta is None:
            meta = self.prepare(plan)
        if isinstance(meta, StaticDecodeStep):
            return self.graphs.run(meta, None if self.stage.first else inputs)
        with torch.inference_mode():
            return self.stage(inputs, meta, self.cache.layers)

    def _cp_kind(self, plan: StepPlan) -> str:
        """ "prefill" (whole fresh prompts) or "decode" (one new token per cached sequence); raises otherwise."""
        if all(start == 0 for start in plan.starts):
            return "prefill"
        if all(q == 1 for q in plan.num_tokens) and all(s in self._cp_len for s in plan.seq_ids):
            return "decode"
        raise ContextParallelError(
            f"a cp step is a prefill of fresh prompts or one new token per cached sequence; got sequences "
            f"{plan.seq_ids} with {plan.num_tokens} new tokens after {plan.starts} cached (prefill on top of cached "
            f"context is not supported yet)"
        )

    def _execute_cp(self, plan: StepPlan, inputs: torch.Tensor) -> torch.Tensor:
        """A prefill of whole fresh prompts on this rank's zigzag share, or a decode token run on
        every cp rank and stored on one (round-robin)."""
        n, me = self.cp.size, self.cp.rank
        seq_ids, q_lens, cache = plan.seq_ids, plan.num_tokens, self.cache
        if self._cp_kind(plan) == "prefill":
            local = [zigzag_chunks(q, n, me).num_rows for q in q_lens]
            tables = [cache.reserve(s, m) for s, m in zip(seq_ids, local)]
            attn = self.stage.layers[0].self_attn if len(self.stage.layers) else None
            meta, mine = cp_prefill_metadata(
                q_lens,
                n,
                me,
                tables,
                self.block_size,
                self.cp_variant,
                attn.q_heads if attn else 1,
                attn.kv_heads if attn else 1,
                self.cfg.sliding_window,
                self.device.type,
                torch.empty((), dtype=self.stage.dtype).element_size(),
            )
            starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
            inputs = inputs[host_index([st + p for st, pos in zip(starts, mine) for p in pos], inputs.device)]
            for s, q in zip(seq_ids, q_lens):
                self._cp_prompt_len[s] = self._cp_len[s] = q
            added = local
        else:
            positions = [self._cp_len[s] for s in seq_ids]
            store = [cp_decode_owner(p, self._cp_prompt_len[s], n) == me for p, s in zip(positions, seq_ids)]
            added = [int(x) for x in store]
            tables = [cache.reserve(s, a) for s, a in zip(seq_ids, added)]
            local_lens = [cache.lengths[s] + a for s, a in zip(seq_ids, added)]
            meta = cp_decode_metadata(positions, store, local_lens, tables, self.block_size)
            for s in seq_ids:
                self._cp_len[s] += 1
        meta = self._on_device(meta)
        with torch.inference_mode():
            out = self.stage(inputs, meta, cache.layers)
        for s, a in zip(seq_ids, added):
            cache.advance(s, a)
        return out
