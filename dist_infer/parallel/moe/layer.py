"""The expert-parallel MoE layer: routing, the all-to-all dispatch and combine, and the ep gather.

This is the one module of the package that talks to other ranks; the routing math, placement
and statistics it uses are kept in their own modules so they stay testable without processes.

The experts of a layer are spread over the ep group; attention before it is replicated across
ep, so every ep rank enters the layer holding the same tokens. Each ep rank then takes its own
contiguous chunk of the step's tokens (uneven, possibly empty: one decode token and ep=4),
routes it, and sends every (token, chosen expert) row with one all-to-all to the rank that owns
the expert. Owners run their experts, a second all-to-all brings the rows back, the sender
weights and sums them, and an all-gather over ep gives every rank all tokens again. Nothing is
ever dropped: the splits are whatever the router asked for.

With tp > 1 each expert is also tensor-parallel (its intermediate dimension split over tp, like
a dense MLP), so ep x tp ranks each hold 1/(ep*tp) of the expert weights. All tp ranks of an ep
rank see the same chunk and route it identically; their partial sums are all-reduced over tp on
the chunk, before the all-gather over ep.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dist_infer.comm.base import Communicator
from dist_infer.parallel.moe.experts import ParallelExperts
from dist_infer.parallel.moe.placement import ExpertPlacement
from dist_infer.parallel.moe.routing import dispatch_order, token_chunk, topk_routing
from dist_infer.parallel.moe.stats import RoutingStats
from dist_infer.parallel.sharding import ShardingError
from dist_infer.parallel.weights import check_shape, copy_into


class ExpertParallelMoE(nn.Module):
    """A routed-experts MLP over the ep group (see the module docstring for the data flow).

    `shared`, if given, is a module computing an always-on expert's un-reduced (over tp) output
    for the same rows (Qwen2-MoE's shared expert); it is added before the tp all-reduce.
    `weights_fp32`: scale expert outputs by the fp32 router weights (Mixtral) rather than by
    weights cast to the activation dtype first (Qwen).
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool,
                 placement: ExpertPlacement, tp: Communicator, ep: Communicator, dtype: torch.dtype = torch.float32,
                 shared: Optional[nn.Module] = None, weights_fp32: bool = False, name: str = "moe"):
        super().__init__()
        if placement.ep != ep.size or placement.num_experts != num_experts:
            raise ShardingError(f"{name}: placement for {placement.num_experts} experts over ep={placement.ep}, "
                                f"the layer has {num_experts} experts over ep={ep.size}")
        self.name, self.tp, self.ep = name, tp, ep
        self.hidden, self.num_experts, self.top_k, self.renormalize = hidden, num_experts, top_k, renormalize
        self.placement = placement
        self.owner = torch.tensor(placement.owner, dtype=torch.long)
        self.mine = torch.tensor(placement.local_experts(ep.rank), dtype=torch.long)
        self.gate = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        self.experts = ParallelExperts(placement, ep.rank, hidden, intermediate, tp, dtype, f"{name}.experts")
        self.shared = shared
        self.weights_fp32 = weights_fp32
        self.stats = RoutingStats(placement)

    def gate_loader(self, source) -> None:
        check_shape(f"{self.name}.gate.weight", source, (self.num_experts, self.hidden))
        copy_into(self.gate, source[:, :], f"{self.name}.gate.weight")

    # -- the step ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H], the same on every ep and tp rank -> [T, H], reduced, on every rank."""
        y = self._chunk_partial(x)
        t0 = time.perf_counter()
        self.tp.all_reduce(y)
        out = self._gather_chunks(y, x.shape[0])
        self.stats.time_s["gather"] += time.perf_counter() - t0
        return out

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """Like forward, but the tp all-reduce is left to the caller (to overlap it): [T, H] partial sums."""
        y = self._chunk_partial(x)
        t0 = time.perf_counter()
        out = self._gather_chunks(y, x.shape[0])
        self.stats.time_s["gather"] += time.perf_counter() - t0
        return out

    def _chunk_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This ep rank's chunk of tokens through the routed (and shared) experts, not reduced over tp."""
        ep, E, k, times = self.ep, self.num_experts, self.top_k, self.stats.time_s
        t0 = time.perf_counter()
        start, n = token_chunk(x.shape[0], ep.size, ep.rank)
        xc = x[start:start + n]
        weights, experts = topk_routing(F.linear(xc, self.gate), k, self.renormalize)
        order = dispatch_order(experts, self.owner)
        send_tokens = order // k
        send_weights = weights.reshape(-1)[order]
        counts = torch.bincount(experts.reshape(-1), minlength=E)
        t1 = time.perf_counter()
        # Every rank learns every rank's tokens per expert: the splits of both all-to-alls and the stats.
        all_counts = torch.empty(ep.size, E, dtype=torch.long)
        ep.all_gather(all_counts, counts)
        per_rank = torch.zeros(ep.size, dtype=torch.long).index_add_(0, self.owner, counts)
        send_splits = per_rank.tolist()
        from_each = all_counts[:, self.mine]  # [ep, E_local]: rows each source sends me, per local expert
        recv_splits = from_each.sum(1).tolist()
        received = x.new_empty(sum(recv_splits), x.shape[1])
        ep.all_to_all(received, xc[send_tokens].contiguous(), recv_splits, send_splits)
        t2 = time.perf_counter()
        local_ids = torch.arange(len(self.mine)).repeat(ep.size).repeat_interleave(from_each.reshape(-1))
        computed = self.experts(received, local_ids)
        t3 = time.perf_counter()
        back = x.new_empty(send_tokens.numel(), x.shape[1])
        ep.all_to_all(back, computed, send_splits, recv_splits)
        scale = send_weights if self.weights_fp32 else send_weights.to(x.dtype)
        y = x.new_zeros(n, x.shape[1]).index_add_(0, send_tokens, (back * scale[:, None]).to(x.dtype))
        if self.shared is not None:
            y = y + self.shared(xc)
        t4 = time.perf_counter()
        self.stats.record(all_counts.sum(0))
        times["route"] += t1 - t0
        times["dispatch"] += t2 - t1
        times["experts"] += t3 - t2
        times["combine"] += t4 - t3
        return y

    def _gather_chunks(self, y: torch.Tensor, total: int) -> torch.Tensor:
        """Every ep rank's chunk, in rank order: [total, H] on every rank (chunks padded to equal size)."""
        ep = self.ep
        if ep.size == 1:
            return y
        width = -(-total // ep.size)
        padded = y.new_zeros(width, y.shape[1])
        padded[: y.shape[0]] = y
        gathered = y.new_empty(ep.size * width, y.shape[1])
        ep.all_gather(gathered, padded)
        parts = [gathered[r * width: r * width + token_chunk(total, ep.size, r)[1]] for r in range(ep.size)]
        return torch.cat(parts)
