"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) as pipeline stages.

The Llama stage with a different MLP: attention (tensor parallel over tp, context parallel over
cp, replicated across ep), RMSNorms, embedding and LM head are Llama's own modules; the MLP of a
sparse layer is an `ExpertParallelMoE` over the ep group. Per family:

- Mixtral: every layer sparse, top-k renormalised, experts `block_sparse_moe.experts.{e}.w1/w3/w2`.
- Qwen2-MoE: a sigmoid-gated shared expert next to the routed ones, top-k renormalised only with
  norm_topk_prob, dense layers where mlp_only_layers / decoder_sparse_step say so, q/k/v biases.
- Qwen3-MoE: RMSNorm over every head's q and k before RoPE (q_norm, k_norm), no shared expert.

Checkpoints may hold each expert's tensors (what transformers 5 writes) or transformers' fused
3-D `mlp.experts.gate_up_proj` / `down_proj` (its in-memory layout); either way a rank reads only
its own experts' slices.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from dist_infer.comm.base import Communicator
from dist_infer.comm.groups import ParallelGroups
from dist_infer.models.checkpoint import CheckpointError
from dist_infer.models.config import ModelConfig
from dist_infer.models.llama import (
    KVCache,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaStage,
)
from dist_infer.models.rms_norm import RMSNorm
from dist_infer.parallel.moe.layer import ExpertParallelMoE
from dist_infer.parallel.moe.placement import ExpertPlacement, imbalance
from dist_infer.parallel.moe.routing_file import read_placement_file
from dist_infer.parallel.moe.stats import PHASES
from dist_infer.parallel.weights import load_replicated

Placements = Union[str, Path, Mapping[int, ExpertPlacement], None]


class HeadNormedQKV(nn.Module):
    """A QKV projection followed by Qwen3's per-head RMSNorm of q and k (weights shared by all heads).

    Wrapping the projection keeps LlamaAttention's forward as it is: it still gets flat q, k, v.
    """

    def __init__(self, qkv: nn.Module, head_dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.inner = qkv
        self.layout = qkv.layout
        self.head_dim = head_dim
        self.q_norm = RMSNorm(head_dim, eps, dtype)
        self.k_norm = RMSNorm(head_dim, eps, dtype)

    def weight_loader(self, source, part: str, which: str = "weight") -> None:
        self.inner.weight_loader(source, part, which)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.inner(x)
        T, d = x.shape[0], self.head_dim
        return self.q_norm(q.reshape(T, -1, d)).reshape(T, -1), self.k_norm(k.reshape(T, -1, d)).reshape(T, -1), v


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: sigmoid(x . w_gate) * MLP(x), its MLP tensor parallel, left un-reduced."""

    def __init__(self, cfg: ModelConfig, tp: Communicator, dtype: torch.dtype, prefix: str):
        super().__init__()
        if cfg.mlp_bias:  # its partial sum is reduced with the routed experts': a bias would be added tp times
            raise ValueError(f"{prefix}: a shared expert with biases is not supported")
        self.mlp = LlamaMLP(
            dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size), tp, dtype, prefix
        )
        self.gate = nn.Parameter(torch.empty(1, cfg.hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.gate)) * self.mlp.down_proj.partial(self.mlp.activated(x))


class MoEDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer (and its forward) with an expert-parallel MLP where the config says so."""

    supports_sequence_parallel = False  # the expert MLP takes replicated tokens (its dispatch has its own layout)

    def __init__(
        self, cfg: ModelConfig, groups: ParallelGroups, dtype: torch.dtype, index: int, placement: ExpertPlacement
    ):
        nn.Module.__init__(self)  # the same four parts as LlamaDecoderLayer, but no dense MLP to throw away
        tp, prefix = groups.tp, f"model.layers.{index}"
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, tp, dtype, f"{prefix}.self_attn", groups.cp)
        if cfg.qk_norm:
            self.self_attn.qkv_proj = HeadNormedQKV(self.self_attn.qkv_proj, cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.sparse = cfg.is_moe_layer(index)
        if not self.sparse:
            self.mlp = LlamaMLP(cfg, tp, dtype, f"{prefix}.mlp")
            return
        shared = None
        if cfg.shared_expert_intermediate_size:
            shared = SharedExpert(cfg, tp, dtype, f"{prefix}.mlp.shared_expert")
        self.mlp = ExpertParallelMoE(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            placement,
            tp,
            groups.ep,
            dtype,
            shared=shared,
            weights_fp32=cfg.model_type == "mixtral",
            name=f"{prefix}.mlp",
        )

    def forward(self, x, cos, sin, kv, meta, rows=None):
        if self.sparse:  # the routing statistics count expert reads of prompt steps apart from decode-only ones
            self.mlp.step_has_prompt = meta.max_q > 1
        return super().forward(x, cos, sin, kv, meta, rows)

    def load_mlp(self, get, cfg: ModelConfig) -> None:
        if not self.sparse:
            return super().load_mlp(get, cfg)
        load_experts(self.mlp, get, f"model.layers.{self.index}", cfg.model_type, cfg.num_experts)


class MoEStage(LlamaStage):
    """A pipeline stage of a Mixtral / Qwen-MoE model on this rank's tp shard and ep experts.

    `placement`: per-layer expert placements, or a routing file (see parallel/moe/routing_file.py) to read
    them from; layers without one use the contiguous placement.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        groups: ParallelGroups,
        layers: range,
        first: bool,
        last: bool,
        dtype: torch.dtype = torch.float32,
        placement: Placements = None,
    ):
        if isinstance(placement, (str, Path)):
            placement = read_placement_file(placement, cfg.num_experts, groups.ep.size)
        placement = placement or {}
        default = ExpertPlacement.contiguous(cfg.num_experts, groups.ep.size)
        super().__init__(
            cfg,
            groups.tp,
            layers,
            first,
            last,
            dtype,
            cp=groups.cp,
            make_layer=lambda i: MoEDecoderLayer(cfg, groups, dtype, i, placement.get(i, default)),
        )
        self.ep = groups.ep

    def _forward_token_split(self, x: torch.Tensor, split, kv_caches: list[KVCache], num_layers: int) -> torch.Tensor:
        """The two halves of a token-split step one after the other, not interleaved (the experts'
        all-to-alls are blocking). Exact: the second half reads the first half's keys from the cache."""
        out = []
        for meta, rows in ((split.a, x[: split.cut]), (split.b, x[split.cut :])):
            cos, sin = self.rotary.cos_sin(meta.positions)
            for layer, kv in zip(self.layers[:num_layers], kv_caches):
                rows = layer(rows, cos, sin, kv, meta)
            out.append(rows)
        return torch.cat(out)

    # -- routing statistics --------------------------------------------------------------------------
    def moe_layers(self) -> dict[int, ExpertParallelMoE]:
        return {layer.index: layer.mlp for layer in self.layers if layer.sparse}

    def routing_stats(self) -> dict:
        """Per sparse layer of this stage: its RoutingStats (last step, history, totals)."""
        return {i: moe.stats for i, moe in self.moe_layers().items()}

    def reset_routing_stats(self) -> None:
        for moe in self.moe_layers().values():
            moe.stats.reset()


def load_experts(moe: ExpertParallelMoE, get, prefix: str, model_type: str, num_experts: int) -> None:
    """A sparse layer's router, this rank's experts (per-expert or fused layout) and the shared expert."""
    per_expert, fused = _expert_layout(model_type, prefix)
    moe.gate_loader(get(_first_present(get, [per_expert["gate"], fused["gate"]])))
    if _first_present(get, [per_expert["w_gate"].format(e=0), fused["gate_up"]]) != fused["gate_up"]:
        for e in moe.experts.experts:
            moe.experts.load_expert(e, *(get(per_expert[w].format(e=e)) for w in ("w_gate", "w_up", "w_down")))
    else:
        moe.experts.load_fused(get(fused["gate_up"]), get(fused["down"]), num_experts)
    if moe.shared is not None:
        moe.shared.mlp.load_weights(get, f"{prefix}.mlp.shared_expert")
        load_replicated(
            moe.shared.gate, get(f"{prefix}.mlp.shared_expert_gate.weight"), f"{prefix}.mlp.shared_expert_gate.weight"
        )


def _expert_layout(model_type: str, prefix: str) -> tuple[dict, dict]:
    """The names of a sparse layer's tensors, per expert (on disk) and fused (transformers in memory)."""
    fused = {
        "gate": f"{prefix}.mlp.gate.weight",
        "gate_up": f"{prefix}.mlp.experts.gate_up_proj",
        "down": f"{prefix}.mlp.experts.down_proj",
    }
    if model_type == "mixtral":
        e = f"{prefix}.block_sparse_moe.experts.{{e}}"
        return {
            "gate": f"{prefix}.block_sparse_moe.gate.weight",
            "w_gate": f"{e}.w1.weight",
            "w_up": f"{e}.w3.weight",
            "w_down": f"{e}.w2.weight",
        }, fused
    e = f"{prefix}.mlp.experts.{{e}}"
    return {
        "gate": f"{prefix}.mlp.gate.weight",
        "w_gate": f"{e}.gate_proj.weight",
        "w_up": f"{e}.up_proj.weight",
        "w_down": f"{e}.down_proj.weight",
    }, fused


def _first_present(get, names: list[str]) -> str:
    """The first of `names` the checkpoint has (names only; no data is read)."""
    for name in names:
        try:
            get(name)
            return name
        except (CheckpointError, KeyError):
            continue
    raise CheckpointError(f"the checkpoint has none of {names}")


def routing_report(stage: MoEStage, groups: ParallelGroups) -> dict:
    """The routing statistics of every sparse layer of the model, on every rank. Collective over the world.

    Counts are summed over the pipeline stages (each layer lives on one); phase times are the
    mean and the max over all ranks.
    """
    cfg = stage.cfg
    L, E = cfg.num_layers, cfg.num_experts
    counts = torch.zeros(L, E, dtype=torch.float64)
    steps = torch.zeros(L, 3, dtype=torch.float64)  # steps, sum of step imbalances, max step imbalance
    sparse = torch.zeros(L, dtype=torch.float64)
    owners = torch.zeros(L, E, dtype=torch.float64)
    times = torch.tensor(
        [sum(s.time_s[p] for s in stage.routing_stats().values()) for p in PHASES], dtype=torch.float64
    )
    reads = torch.zeros(2, dtype=torch.float64)  # expert weight reads in prompt steps, in decode-only steps
    for i, s in stage.routing_stats().items():
        reads += torch.tensor([s.expert_reads["prompt"], s.expert_reads["decode"]], dtype=torch.float64)
        counts[i] = s.expert_tokens
        steps[i] = torch.tensor([s.steps, s.imbalance_sum, s.imbalance_max], dtype=torch.float64)
        sparse[i] = 1.0
        owners[i] = torch.tensor(s.placement.owner, dtype=torch.float64)
    packed = torch.cat([counts.view(-1), steps.view(-1), sparse, owners.view(-1), reads])
    groups.pp.all_reduce(packed)
    packed, reads = packed[:-2], packed[-2:]
    counts, steps = packed[: L * E].view(L, E), packed[L * E : L * E + 3 * L].view(L, 3)
    sparse, owners = packed[L * E + 3 * L : L * E + 4 * L], packed[L * E + 4 * L :].view(L, E)
    time_sum, time_max = times.clone(), times.clone()
    groups.world.all_reduce(time_sum)
    groups.world.all_reduce(time_max, op="max")
    time_mean = time_sum / groups.world.size
    layers = {}
    total_rank = [0.0] * groups.ep.size
    for i in range(L):
        if not sparse[i]:
            continue
        placement = ExpertPlacement(tuple(int(o) for o in owners[i].tolist()), groups.ep.size)
        per_rank = placement.rank_loads(counts[i].tolist())
        total_rank = [a + b for a, b in zip(total_rank, per_rank)]
        n = steps[i, 0].item()
        layers[i] = {
            "tokens_per_expert": counts[i].tolist(),
            "tokens_per_rank": per_rank,
            "imbalance": imbalance(per_rank),
            "step_imbalance_mean": steps[i, 1].item() / n if n else 1.0,
            "step_imbalance_max": steps[i, 2].item() if n else 1.0,
            "steps": int(n),
            "placement": placement.owner,
        }
    mean = dict(zip(PHASES, time_mean.tolist()))
    exchange = mean["dispatch"] + mean["combine"]
    return {
        "ep": groups.ep.size,
        "num_experts": E,
        "top_k": cfg.num_experts_per_tok,
        "layers": layers,
        "tokens_per_rank": total_rank,
        "expert_reads": {"prompt": int(reads[0]), "decode": int(reads[1])},
        "expert_bytes": {
            k: int(n) * expert_bytes(cfg, stage.dtype) for k, n in zip(("prompt", "decode"), reads.tolist())
        },
        "imbalance": imbalance(total_rank),
        "time_s_mean": mean,
        "time_s_max": dict(zip(PHASES, time_max.tolist())),
        "dispatch_combine_over_experts": exchange / mean["experts"] if mean["experts"] else None,
    }


def expert_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The bytes of one routed expert's weights (gate, up and down projections, all tp shards)."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * torch.empty((), dtype=dtype).element_size()


def format_routing_report(report: dict) -> str:
    """A few lines for people: imbalance per layer, tokens per rank, where the MoE time went."""
    lines = [
        f"moe: ep={report['ep']}, {report['num_experts']} experts, top-{report['top_k']}; "
        f"tokens per ep rank {[int(x) for x in report['tokens_per_rank']]}, imbalance (max/mean) "
        f"{report['imbalance']:.2f}"
    ]
    for i, layer in report["layers"].items():
        lines.append(
            f"  layer {i}: tokens per expert {[int(x) for x in layer['tokens_per_expert']]}, imbalance "
            f"{layer['imbalance']:.2f} (per step: mean {layer['step_imbalance_mean']:.2f}, "
            f"max {layer['step_imbalance_max']:.2f})"
        )
    t = report["time_s_mean"]
    ratio = report["dispatch_combine_over_experts"]
    reads, nbytes = report["expert_reads"], report["expert_bytes"]
    lines.append(
        f"  expert weights read: {reads['prompt']} times in steps with prompt tokens "
        f"({nbytes['prompt'] / 2**20:.0f} MiB), {reads['decode']} in decode-only steps "
        f"({nbytes['decode'] / 2**20:.0f} MiB)"
    )
    lines.append(
        "  time per rank (mean over ranks): "
        + ", ".join(f"{p} {t[p] * 1e3:.1f} ms" for p in PHASES)
        + (f"; dispatch+combine / experts = {ratio:.2f}" if ratio is not None else "")
    )
    return "\n".join(lines)


def is_moe_stage(stage) -> bool:
    return isinstance(stage, MoEStage)


def moe_report(stage, groups: ParallelGroups) -> Optional[dict]:
    """The routing statistics of an MoE model (collective: every rank calls it), None for a dense one."""
    return routing_report(stage, groups) if is_moe_stage(stage) else None
