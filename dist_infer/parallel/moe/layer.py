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
from dataclasses import dataclass
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


@dataclass
class Routing:
    """One ep rank's chunk of a step routed (`ExpertParallelMoE.route`), on the activations' device:
    its rows [start, start + n), and its (token, expert) pairs in dispatch order."""

    start: int
    n: int
    tokens: torch.Tensor  # [n * k] row in the chunk of each pair
    weights: torch.Tensor  # [n * k] fp32 router weight of each pair
    counts: torch.Tensor  # [E] pairs per expert


class ExpertParallelMoE(nn.Module):
    """A routed-experts MLP over the ep group (see the module docstring for the data flow).

    `shared`, if given, is a module computing an always-on expert's un-reduced (over tp) output
    for the same rows (Qwen2-MoE's shared expert); it is added before the tp all-reduce.
    `weights_fp32`: scale expert outputs by the fp32 router weights (Mixtral) rather than by
    weights cast to the activation dtype first (Qwen).
    """

    owner: torch.Tensor  # a buffer (registered in __init__)

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        placement: ExpertPlacement,
        tp: Communicator,
        ep: Communicator,
        dtype: torch.dtype = torch.float32,
        shared: Optional[nn.Module] = None,
        weights_fp32: bool = False,
        name: str = "moe",
    ):
        super().__init__()
        if placement.ep != ep.size or placement.num_experts != num_experts:
            raise ShardingError(
                f"{name}: placement for {placement.num_experts} experts over ep={placement.ep}, "
                f"the layer has {num_experts} experts over ep={ep.size}"
            )
        self.name, self.tp, self.ep = name, tp, ep
        self.hidden, self.num_experts, self.top_k, self.renormalize = hidden, num_experts, top_k, renormalize
        self.placement = placement
        # expert -> owner rank, a buffer: it indexes the router's device output, so it goes where the layer goes
        self.register_buffer("owner", torch.tensor(placement.owner, dtype=torch.long), persistent=False)
        self.gate = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        self.experts = ParallelExperts(placement, ep.rank, hidden, intermediate, tp, dtype, f"{name}.experts")
        self.shared = shared
        self.weights_fp32 = weights_fp32
        self.stats = RoutingStats(placement)
        self.step_has_prompt = False  # set by the decoder layer per call: whose weight reads the stats count

    def gate_loader(self, source) -> None:
        check_shape(f"{self.name}.gate.weight", source, (self.num_experts, self.hidden))
        copy_into(self.gate, source[:, :], f"{self.name}.gate.weight")

    # -- the step ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H], the same on every ep and tp rank -> [T, H], reduced, on every rank."""
        y = self._chunk_partial(x)
        t0 = time.perf_counter()
        self.tp.all_reduce(y)
        out = self.gather_chunks(y, x.shape[0])
        self.stats.time_s["gather"] += time.perf_counter() - t0
        return out

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """Like forward, but the tp all-reduce is left to the caller (to overlap it): [T, H] partial sums."""
        y = self._chunk_partial(x)
        t0 = time.perf_counter()
        out = self.gather_chunks(y, x.shape[0])
        self.stats.time_s["gather"] += time.perf_counter() - t0
        return out

    def _chunk_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This ep rank's chunk of tokens through the routed (and shared) experts, not reduced over tp."""
        times = self.stats.time_s
        t0 = time.perf_counter()
        routing = self.route(x)
        t1 = time.perf_counter()
        counts = self.routing_counts(routing.counts)
        times["route"] += t1 - t0
        times["dispatch"] += time.perf_counter() - t1
        return self.exchange(x, routing, counts)

    def route(self, x: torch.Tensor) -> Routing:
        """This ep rank's chunk of `x` routed, on x's device: which rows go where, with what weight."""
        start, n = token_chunk(x.shape[0], self.ep.size, self.ep.rank)
        weights, experts = topk_routing(F.linear(x[start : start + n], self.gate), self.top_k, self.renormalize)
        order = dispatch_order(experts, self.owner)
        flat = experts.reshape(-1)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount's counts, without its host read of the max
        return Routing(start, n, order // self.top_k, weights.reshape(-1)[order], counts)

    def routing_counts(self, counts: torch.Tensor) -> list[list[int]]:
        """Every ep rank's (token, expert) pairs per expert, [ep][E], on the host: the all-to-alls'
        split sizes and the statistics. The layer's one read of device values (a sync on a GPU)."""
        all_counts = counts.new_empty(self.ep.size, self.num_experts)
        self.ep.all_gather(all_counts, counts)
        return all_counts.tolist()

    def exchange(self, x: torch.Tensor, routing: Routing, counts: list[list[int]]) -> torch.Tensor:
        """Dispatch the routed rows, run this rank's experts, send the results back and sum them
        per token (plus the shared expert): [n, H] for this rank's chunk, not reduced over tp."""
        ep, times = self.ep, self.stats.time_s
        t0 = time.perf_counter()
        mine = self.placement.local_experts(ep.rank)
        send_splits = [sum(counts[ep.rank][e] for e in self.placement.local_experts(r)) for r in range(ep.size)]
        from_each = [[counts[src][e] for e in mine] for src in range(ep.size)]  # rows each source sends me
        recv_splits = [sum(row) for row in from_each]
        xc = x[routing.start : routing.start + routing.n]
        received = x.new_empty(sum(recv_splits), x.shape[1])
        ep.all_to_all(received, xc[routing.tokens].contiguous(), recv_splits, send_splits)
        t1 = time.perf_counter()
        repeats = torch.tensor([c for row in from_each for c in row], dtype=torch.long)
        local_ids = torch.arange(len(mine)).repeat(ep.size).repeat_interleave(repeats, output_size=sum(recv_splits))
        sizes = [sum(row[j] for row in from_each) for j in range(len(mine))]
        computed = self.experts(received, local_ids.to(x.device), sizes)
        t2 = time.perf_counter()
        back = x.new_empty(routing.tokens.numel(), x.shape[1])
        ep.all_to_all(back, computed, send_splits, recv_splits)
        scale = routing.weights if self.weights_fp32 else routing.weights.to(x.dtype)
        y = x.new_zeros(routing.n, x.shape[1]).index_add_(0, routing.tokens, (back * scale[:, None]).to(x.dtype))
        if self.shared is not None:
            y = y + self.shared(xc)
        self.stats.record(torch.tensor(counts, dtype=torch.long).sum(0), self.step_has_prompt)
        times["dispatch"] += t1 - t0
        times["experts"] += t2 - t1
        times["combine"] += time.perf_counter() - t2
        return y

    def gather_chunks(self, y: torch.Tensor, total: int) -> torch.Tensor:
        """Every ep rank's chunk, in rank order: [total, H] on every rank (chunks padded to equal size)."""
        ep = self.ep
        if ep.size == 1:
            return y
        width = -(-total // ep.size)
        padded = y.new_zeros(width, y.shape[1])
        padded[: y.shape[0]] = y
        gathered = y.new_empty(ep.size * width, y.shape[1])
        ep.all_gather(gathered, padded)
        parts = [gathered[r * width : r * width + token_chunk(total, ep.size, r)[1]] for r in range(ep.size)]
        return torch.cat(parts)
