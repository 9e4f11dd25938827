"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2) as one pipeline stage of tensor-parallel layers.

A stage holds a contiguous range of decoder layers; the first stage also embeds, the last also
normalises and projects to the vocabulary. With pp=1 one stage is the whole model.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from dist_infer.comm.base import Communicator
from dist_infer.models.attention import (
    attention_gpu,
    attention_native,
    last_token_attention_native,
    native_kernels_for,
    paged_attention,
)
from dist_infer.models.attention_metadata import AttentionMetadata, TokenSplit
from dist_infer.models.config import ModelConfig
from dist_infer.models.cp_attention import cp_attention, cp_last_hidden, cp_last_token_attention
from dist_infer.models.fused_decode import fused_decode
from dist_infer.models.ladder import LadderPlan, run_ladder_stage
from dist_infer.models.layered import LayeredStep, run_layered_stage
from dist_infer.models.rms_norm import RMSNorm
from dist_infer.models.rope import Rotary, apply_rotary
from dist_infer.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from dist_infer.parallel.linear import skinny_linear
from dist_infer.parallel.sequence_parallel import (
    gather_from_sequence_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
)
from dist_infer.parallel.token_split import run_layers_token_split
from dist_infer.parallel.weights import load_replicated

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: Communicator, dtype: torch.dtype, prefix: str, cp: Optional[Communicator] = None
    ):
        super().__init__()
        self.cp = cp  # the context-parallel group, used when a step's metadata says the sequence is sharded
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            tp,
            bias=cfg.qkv_bias,
            dtype=dtype,
            name=f"{prefix}.qkv_proj",
        )
        heads = self.qkv_proj.layout
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim,
            cfg.hidden_size,
            tp,
            bias=cfg.o_bias,
            dtype=dtype,
            name=f"{prefix}.o_proj",
            in_range=(heads.q_start * cfg.head_dim, heads.q_heads * cfg.head_dim),
        )
        self.q_heads, self.kv_heads = heads.q_heads, heads.kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.kernels = None  # the native CPU kernels, given by use_native_kernels
        self.gpu_kernels = None  # the Triton kernels, given by use_gpu_kernels

    def forward(self, x, cos, sin, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(x, cos, sin, kv, meta))

    def load_weights(self, get: Callable[[str], object], prefix: str, cfg: ModelConfig) -> None:
        for part in "qkv":
            self.qkv_proj.weight_loader(get(f"{prefix}.{part}_proj.weight"), part)
            if cfg.qkv_bias:
                self.qkv_proj.weight_loader(get(f"{prefix}.{part}_proj.bias"), part, "bias")
        self.o_proj.weight_loader(get(f"{prefix}.o_proj.weight"))
        if cfg.o_bias:
            self.o_proj.weight_loader(get(f"{prefix}.o_proj.bias"), "bias")
        if getattr(cfg, "qk_norm", False):  # Qwen3: per-head RMSNorm of q and k
            for norm in ("q_norm", "k_norm"):
                load_replicated(
                    getattr(self.qkv_proj, norm).weight, get(f"{prefix}.{norm}.weight"), f"{prefix}.{norm}.weight"
                )

    def attend(self, x, cos, sin, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Attention up to o_proj's input: [tokens, local heads * head_dim]."""
        q, k, v = self.qkv_proj(x)
        out = attention_gpu(q, k, v, cos, sin, kv[0], kv[1], meta, self.scale, self.q_heads, self.gpu_kernels)
        if out is not None:
            return out
        out = attention_native(q, k, v, cos, sin, kv[0], kv[1], meta, self.scale, self.kernels)  # None: not native
        if out is not None:
            return out
        q, k, v = self._heads_rotated(q, k, v, cos, sin)
        if meta.cp is not None:
            return cp_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.cp, self.kernels)
        return paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)

    def _heads_rotated(self, q, k, v, cos, sin):
        """qkv_proj's outputs as [T, heads, head_dim], with RoPE applied to q and k."""
        T = q.shape[0]
        return (
            apply_rotary(q.view(T, self.q_heads, self.head_dim), cos, sin),
            apply_rotary(k.view(T, self.kv_heads, self.head_dim), cos, sin),
            v.view(T, self.kv_heads, self.head_dim),
        )

    def attend_last_tokens_cp(self, x, cos, sin, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """The last layer of a cp prefill: every row's K/V to the cache, attention for each
        sequence's last token only ([B, local heads * head_dim], the same on every cp rank)."""
        q, k, v = self._heads_rotated(*self.qkv_proj(x), cos, sin)
        return cp_last_token_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.cp)

    def attend_last_tokens(self, x, cos, sin, kv: KVCache, meta: AttentionMetadata) -> Optional[torch.Tensor]:
        """`attend(x)[meta.last_token_index]` for the model's last layer, computing queries and
        attention for those rows only (keys and values of every token still go to the cache).
        None where the native kernels do not serve the step: then the caller attends in full."""
        qkv = self.qkv_proj
        if (
            type(qkv) is not QKVParallelLinear
            or qkv.quantized is not None
            or native_kernels_for(x, kv[0], meta, self.kernels) is None
        ):
            return None
        qs = qkv.q_size
        bias = qkv.bias
        kv_out = skinny_linear(x, qkv.weight[qs:], None if bias is None else bias[qs:], self.kernels)
        q = skinny_linear(x[meta.last_token_index], qkv.weight[:qs], None if bias is None else bias[:qs], self.kernels)
        k, v = kv_out.split([qkv.kv_size, qkv.kv_size], dim=-1)
        return last_token_attention_native(q, k, v, cos, sin, kv[0], kv[1], meta, self.scale, self.kernels)


class LlamaMLP(nn.Module):
    ROW_CHUNK = 8192  # rows per MLP slice on long prefills (see forward)

    def __init__(self, cfg: ModelConfig, tp: Communicator, dtype: torch.dtype, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size,
            [cfg.intermediate_size] * 2,
            tp,
            bias=cfg.mlp_bias,
            dtype=dtype,
            name=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, tp, bias=cfg.mlp_bias, dtype=dtype, name=f"{prefix}.down_proj"
        )
        self.gpu_kernels = None  # the Triton kernels, given by use_gpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A long prefill runs in slices of `ROW_CHUNK` rows: its gate/up output and activation are
        2-3 x intermediate values per row, the largest temporaries of a layer (the peak of a long
        prefill, cp ranks included), and every row is independent. One all-reduce for all slices."""
        return self.down_proj.finish(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """down_proj's partial sums of `x`, before the all-reduce (in `ROW_CHUNK` slices, see forward)."""
        rows = x.shape[0]
        if rows <= self.ROW_CHUNK:
            return self.down_proj.partial(self.activated(x))
        out = x.new_empty(rows, self.down_proj.out_features)
        for start in range(0, rows, self.ROW_CHUNK):
            piece = x[start : start + self.ROW_CHUNK]
            out[start : start + piece.shape[0]] = self.down_proj.partial(self.activated(piece))
        return out

    def load_weights(self, get: Callable[[str], object], prefix: str, bias: bool = False) -> None:
        for i, proj in enumerate(("gate_proj", "up_proj")):
            self.gate_up_proj.weight_loader(get(f"{prefix}.{proj}.weight"), i)
            if bias:
                self.gate_up_proj.weight_loader(get(f"{prefix}.{proj}.bias"), i, "bias")
        self.down_proj.weight_loader(get(f"{prefix}.down_proj.weight"))
        if bias:
            self.down_proj.weight_loader(get(f"{prefix}.down_proj.bias"), "bias")

    def activated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up: down_proj's input."""
        gate, up = self.gate_up_proj(x)
        gpu = self.gpu_kernels
        if gpu is not None and gate.dim() == 2 and gate.stride(-1) == 1 and gpu.serves(gate):
            return gpu.silu_mul(gate, up)
        return F.silu(gate) * up


class LlamaDecoderLayer(nn.Module):
    supports_sequence_parallel = True

    def __init__(
        self, cfg: ModelConfig, tp: Communicator, dtype: torch.dtype, index: int, cp: Optional[Communicator] = None
    ):
        super().__init__()
        prefix = f"model.layers.{index}"
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, tp, dtype, f"{prefix}.self_attn", cp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, tp, dtype, f"{prefix}.mlp")

    def forward(
        self, x, cos, sin, kv: KVCache, meta: AttentionMetadata, rows: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """`rows`: keep only these tokens after attention. The model's last layer needs every
        token's keys in the cache, but only each sequence's last token goes on to the LM head,
        so o_proj and the MLP (most of a layer's FLOPs) run on those rows alone: exact, since
        everything after attention works row by row."""
        normed = self.input_layernorm(x)
        h = None
        if rows is not None and getattr(meta, "cp", None) is not None:  # a cp prefill's last layer
            h = self.self_attn.attend_last_tokens_cp(normed, cos, sin, kv, meta)
            x, normed = self.post_attention_layernorm.add_and_norm(
                cp_last_hidden(x, meta, self.self_attn.cp), self.self_attn.o_proj(h)
            )
            return x + self.mlp(normed)
        if rows is not None and rows is meta.last_token_index:
            h = self.self_attn.attend_last_tokens(normed, cos, sin, kv, meta)
        if h is None:
            h = self.self_attn.attend(normed, cos, sin, kv, meta)
            if rows is not None:
                h = h[rows]
        if rows is not None:
            x = x[rows]
        x, normed = self.post_attention_layernorm.add_and_norm(x, self.self_attn.o_proj(h))
        return x + self.mlp(normed)

    def forward_sequence_parallel(
        self, x_local: torch.Tensor, tokens: int, cos, sin, kv: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The layer on this rank's rows of the residual stream (parallel/sequence_parallel.py):
        norms and residual adds on T/tp rows, all-gather before each column-parallel projection,
        reduce-scatter after each row-parallel one."""
        attn, mlp = self.self_attn, self.mlp
        tp = attn.o_proj.tp
        h = attn.attend(gather_from_sequence_parallel(self.input_layernorm(x_local), tp, tokens), cos, sin, kv, meta)
        x_local = x_local + attn.o_proj.add_bias(reduce_scatter_to_sequence_parallel(attn.o_proj.partial(h), tp))
        h = mlp.activated(gather_from_sequence_parallel(self.post_attention_layernorm(x_local), tp, tokens))
        return x_local + mlp.down_proj.add_bias(reduce_scatter_to_sequence_parallel(mlp.down_proj.partial(h), tp))

    def load_weights(self, get: Callable[[str], object], cfg: ModelConfig) -> None:
        p = f"model.layers.{self.index}"
        self.self_attn.load_weights(get, f"{p}.self_attn", cfg)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            load_replicated(getattr(self, norm).weight, get(f"{p}.{norm}.weight"), f"{p}.{norm}.weight")
        self.load_mlp(get, cfg)

    def load_mlp(self, get: Callable[[str], object], cfg: ModelConfig) -> None:
        """The MLP's weights (MoE layers override this)."""
        self.mlp.load_weights(get, f"model.layers.{self.index}.mlp", cfg.mlp_bias)


class LlamaStage(nn.Module):
    """Layers `layers` of the model on this rank's tp shard; embeds if first, projects if last."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: Communicator,
        layers: range,
        first: bool,
        last: bool,
        dtype: torch.dtype = torch.float32,
        cp: Optional[Communicator] = None,
        make_layer: Optional[Callable[[int], nn.Module]] = None,
    ):
        """`make_layer(i)` builds decoder layer i (default: LlamaDecoderLayer; MoE families pass theirs)."""
        super().__init__()
        self.cfg, self.tp, self.layer_ids = cfg, tp, layers
        self.cp = cp
        self.first, self.last = first, last
        self.dtype = dtype
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype) if first else None
        make_layer = make_layer or (lambda i: LlamaDecoderLayer(cfg, tp, dtype, i, cp))
        self.layers = nn.ModuleList(make_layer(i) for i in layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if last else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype) if last else None
        self.tied = first and last and cfg.tie_word_embeddings  # both own the same vocabulary rows: hold them once
        if self.tied:  # (held quantized, the embedding hands the head its packed table: see set_quantization)
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.max_positions, cfg.rope_theta, cfg.rope_scaling)
        layout = self.layers[0].self_attn if len(self.layers) else None
        self.kv_heads_local = layout.kv_heads if layout else 0
        self.ladder = LadderPlan(cfg, layers, cp.size if cp is not None else 1)
        self.native_decode_stack = True  # a step's layers in one native call where it serves (--native-kernels)
        self.decode_stack_cache = None  # fused_decode's plan for this stage (models/fused_decode.py)
        self.prompt_bf16 = False  # prompt tokens' products in bf16 in the native call (--prompt-dtype)
        self.input_width = self.ladder.input_width  # a later stage's hidden states in (2H inside a ladder range)

    def forward(self, inputs: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache]) -> torch.Tensor:
        """`inputs`: token ids [T] on the first stage, hidden states [T, input_width] after it.

        Returns hidden states [T, H] ([T, 2H] where a ladder range runs on into the next stage:
        models/ladder.py), or on the last stage the logits [B, vocab] of each
        sequence's last new token.
        """
        x = self.embed_tokens(inputs) if self.first else inputs
        if isinstance(meta, LayeredStep):  # one prompt in the middle of its layers (pp=1: models/layered.py)
            return self.lm_head(self.norm(run_layered_stage(self, x, meta, kv_caches)))
        split = meta if isinstance(meta, TokenSplit) else None
        meta = split.full if split else meta
        # The last layer keeps only each sequence's last token (see LlamaDecoderLayer.forward).
        cp_meta = getattr(meta, "cp", None)
        # under cp, a prefill's last layer attends each sequence's last token only (cp_last_token_attention)
        trim = (
            self.last
            and len(self.layers) > 0
            and meta.logit_rows is None  # verifying proposals: the last layer runs every row
            and (
                (cp_meta is None and x.shape[0] > meta.batch)
                or (cp_meta is not None and cp_meta.phase == "prefill" and split is None)
            )
        )
        fused = None if split or meta.sequence_parallel else fused_decode(self, x, meta, kv_caches)
        if fused is not None:  # the step in native calls (models/fused_decode.py): every row, untrimmed
            x, trim = fused, False
        elif self.ladder.active:  # the step's full metadata: no token split, no sequence parallelism
            x = run_ladder_stage(self, x, meta, kv_caches, trim)
        else:
            x = self._forward_layers(x, split, meta, kv_caches, trim)
        last_index = meta.last_token_index
        if not self.last:
            return x
        if cp_meta is not None and not trim:
            return self.lm_head(self.norm(cp_last_hidden(x, meta, self.cp)))
        if meta.logit_rows is not None:  # speculative verification: a sequence's last few rows
            return self.lm_head(self.norm(x[meta.logit_rows]))
        if trim or (meta.decode and x.shape[0] == meta.batch):  # every row is a sequence's last: no gather
            return self.lm_head(self.norm(x))
        return self.lm_head(self.norm(x[last_index]))

    def _forward_layers(
        self,
        x: torch.Tensor,
        split: Optional[TokenSplit],
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        trim: bool,
    ) -> torch.Tensor:
        """The stage's (standard) layers: token-split, sequence-parallel or plain, as the step's metadata says."""
        unsplit = range(len(self.layers))
        if split:
            interleaved = len(self.layers) - 1 if trim else len(self.layers)
            x = self._forward_token_split(x, split, kv_caches, interleaved)
            unsplit = range(interleaved, len(self.layers))
        if len(unsplit):
            cos, sin = self.rotary.cos_sin(meta.positions)
            if meta.sequence_parallel and self.tp.size > 1:
                sp = []  # the leading layers that can run it (not the trimmed last, nor MoE layers)
                for i in unsplit:
                    if (trim and i == len(self.layers) - 1) or not getattr(
                        self.layers[i], "supports_sequence_parallel", False
                    ):
                        break
                    sp.append(i)
                x = self._forward_sequence_parallel(x, sp, cos, sin, kv_caches, meta)
                unsplit = list(unsplit)[len(sp) :]
            for i in unsplit:
                rows = meta.last_token_index if trim and i == len(self.layers) - 1 else None
                x = self.layers[i](x, cos, sin, kv_caches[i], meta, rows)
        return x

    def _forward_sequence_parallel(
        self, x: torch.Tensor, layers: list[int], cos, sin, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Layers `layers` (consecutive, in order) with the residual stream split by rows over tp; x in
        and out replicated."""
        if not layers:
            return x
        tokens = x.shape[0]
        x_local = scatter_to_sequence_parallel(x, self.tp)
        for i in layers:
            x_local = self.layers[i].forward_sequence_parallel(x_local, tokens, cos, sin, kv_caches[i], meta)
        return gather_from_sequence_parallel(x_local, self.tp, tokens)

    def _forward_token_split(
        self, x: torch.Tensor, split: "TokenSplit", kv_caches: list[KVCache], num_layers: int
    ) -> torch.Tensor:
        """The first `num_layers` layers with the two token halves interleaved so every all-reduce is overlapped."""
        stage, halves = self, (split.a, split.b)
        rope = [self.rotary.cos_sin(m.positions) for m in halves]

        class Ops:
            def attn(self, i, h, half):
                layer = stage.layers[i]
                cos, sin = rope[half]
                out = layer.self_attn.attend(layer.input_layernorm(h), cos, sin, kv_caches[i], halves[half])
                return layer.self_attn.o_proj.partial(out)

            def attn_done(self, i, y):
                return stage.layers[i].self_attn.o_proj.add_bias(y)

            def mlp(self, i, h):
                layer = stage.layers[i]
                return layer.mlp.down_proj.partial(layer.mlp.activated(layer.post_attention_layernorm(h)))

            def mlp_done(self, i, y):
                return stage.layers[i].mlp.down_proj.add_bias(y)

        x_a, x_b = run_layers_token_split(num_layers, x[: split.cut], x[split.cut :], self.tp, Ops())
        return torch.cat([x_a, x_b])

    # -- loading ----------------------------------------------------------------------------
    def load_weights(self, get: Callable[[str], object]) -> None:
        """Load this stage's shard; `get(name)` returns a weight source (tensor or lazy slice)."""
        if self.first:
            self.embed_tokens.weight_loader(get("model.embed_tokens.weight"))
        for layer in self.layers:
            layer.load_weights(get, self.cfg)
        if self.last:
            load_replicated(self.norm.weight, get("model.norm.weight"), "model.norm.weight")
            if not self.tied:
                head = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
                self.lm_head.weight_loader(get(head))
