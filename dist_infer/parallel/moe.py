"""Expert-parallel mixture of experts: routing, expert placement and the all-to-all layer.

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

Pure functions (routing, chunking, placement) are unit tested without processes.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from dist_infer.comm.base import Communicator
from dist_infer.parallel.sharding import ShardingError, shard_range
from dist_infer.parallel.weights import check_shape, copy_into

ROUTING_FILE_KIND = "dist-infer expert routing"
PHASES = ("route", "dispatch", "experts", "combine", "gather")


# -- routing math ------------------------------------------------------------------------------

def topk_routing(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's and Qwen-MoE's router: softmax over all experts in fp32, then the top k.

    Returns (weights [n, k] fp32, expert ids [n, k]), ids in descending probability. With
    `renormalize` the k weights are divided by their sum (Mixtral always, Qwen by norm_topk_prob).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def token_chunk(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of part `index` when `total` tokens are cut into `parts` contiguous chunks.

    The first `total % parts` chunks get one token more; chunks may be empty (total < parts).
    """
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


def dispatch_order(experts: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """The order in which a rank sends its (token, slot) pairs: by destination rank, then expert.

    `experts` [n, k] are expert ids, `owner` [E] the ep rank of each expert. Returns indices into
    the flattened [n*k] pairs. The receiver relies on this order: from each source it gets its
    experts' rows one expert after another, in ascending expert id.
    """
    flat = experts.reshape(-1)
    key = owner[flat] * owner.numel() + flat
    return torch.argsort(key, stable=True)


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of the tokens per rank: 1.0 is perfect balance, ep means one rank got everything."""
    loads = [float(x) for x in loads]
    total = sum(loads)
    return max(loads) * len(loads) / total if total > 0 else 1.0


# -- placement ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertPlacement:
    """Which ep rank owns each expert of one layer; every rank owns the same number of experts."""

    owner: tuple  # owner[e] = ep rank of expert e
    ep: int

    def __post_init__(self):
        E, ep = len(self.owner), self.ep
        if E % ep:
            raise ShardingError(f"{E} experts cannot be split evenly over ep={ep} ({E} % {ep} = {E % ep})")
        bad = [o for o in self.owner if not 0 <= int(o) < ep]
        if bad:
            raise ShardingError(f"expert placement {list(self.owner)} names ranks {bad} outside ep={ep}")
        per_rank = [sum(1 for o in self.owner if o == r) for r in range(ep)]
        if len(set(per_rank)) != 1:
            raise ShardingError(f"expert placement {list(self.owner)} gives the {ep} ranks {per_rank} experts; "
                                f"each must own {E // ep}")

    @classmethod
    def contiguous(cls, num_experts: int, ep: int) -> "ExpertPlacement":
        """Rank r owns experts [r*E/ep, (r+1)*E/ep): the default."""
        if num_experts % ep:
            raise ShardingError(f"{num_experts} experts cannot be split evenly over ep={ep} "
                                f"({num_experts} % {ep} = {num_experts % ep})")
        per = num_experts // ep
        return cls(tuple(e // per for e in range(num_experts)), ep)

    @property
    def num_experts(self) -> int:
        return len(self.owner)

    def local_experts(self, rank: int) -> list[int]:
        """The experts `rank` owns, ascending (the order of its local weights)."""
        return [e for e, o in enumerate(self.owner) if o == rank]

    def rank_loads(self, expert_counts: Sequence[float]) -> list[float]:
        loads = [0.0] * self.ep
        for e, n in enumerate(expert_counts):
            loads[self.owner[e]] += float(n)
        return loads


def balanced_placement(counts: Sequence[float], ep: int) -> list[int]:
    """An owner rank per expert that evens out the measured tokens per rank, E/ep experts each.

    Greedy longest-processing-time first (heaviest expert to the least loaded rank with room),
    then pairwise swaps between the heaviest rank and any other while they lower the heavier of
    the two. Deterministic: ties go to the lower expert id and the lower rank.
    """
    E = len(counts)
    if E % ep:
        raise ShardingError(f"{E} experts cannot be split evenly over ep={ep} ({E} % {ep} = {E % ep})")
    cap = E // ep
    counts = [float(c) for c in counts]
    owner = [-1] * E
    loads, sizes = [0.0] * ep, [0] * ep
    for e in sorted(range(E), key=lambda e: (-counts[e], e)):
        r = min((r for r in range(ep) if sizes[r] < cap), key=lambda r: (loads[r], r))
        owner[e], loads[r], sizes[r] = r, loads[r] + counts[e], sizes[r] + 1
    for _ in range(E * E):
        heavy = max(range(ep), key=lambda r: (loads[r], -r))
        best = None  # (new max of the pair, a, b)
        for a in (e for e in range(E) if owner[e] == heavy):
            for b in (e for e in range(E) if owner[e] != heavy and counts[e] < counts[a]):
                other = owner[b]
                delta = counts[a] - counts[b]
                pair_max = max(loads[heavy] - delta, loads[other] + delta)
                if pair_max < loads[heavy] - 1e-9 and (best is None or pair_max < best[0]):
                    best = (pair_max, a, b)
        if best is None:
            break
        _, a, b = best
        other, delta = owner[b], counts[a] - counts[b]
        owner[a], owner[b] = other, heavy
        loads[heavy] -= delta
        loads[other] += delta
    return owner


def write_routing_file(path: Union[str, Path], counts: Mapping[int, Sequence[float]], ep: int) -> dict:
    """Save measured tokens per expert (per layer) and the balanced placement for `ep`, as JSON."""
    counts = {int(layer): [float(c) for c in row] for layer, row in sorted(counts.items())}
    num_experts = len(next(iter(counts.values()))) if counts else 0
    placement = {layer: balanced_placement(row, ep) for layer, row in counts.items()}
    contiguous = ExpertPlacement.contiguous(num_experts, ep) if counts else None
    data = {
        "kind": ROUTING_FILE_KIND,
        "num_experts": num_experts,
        "ep": ep,
        "counts": {str(layer): row for layer, row in counts.items()},
        "placement": {str(layer): owner for layer, owner in placement.items()},
        "imbalance_contiguous": {str(layer): imbalance(contiguous.rank_loads(row)) for layer, row in counts.items()},
        "imbalance_balanced": {str(layer): imbalance(ExpertPlacement(tuple(placement[layer]), ep).rank_loads(row))
                               for layer, row in counts.items()},
    }
    lines = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in data.items()]  # a layer per line at most
    Path(path).write_text("{\n" + ",\n".join(lines) + "\n}\n")
    return data


def read_placement_file(path: Union[str, Path], num_experts: int, ep: int) -> dict[int, ExpertPlacement]:
    """Per-layer placements from a routing file, for a job with `ep` ranks.

    The file's own placement is used when it was computed for this ep; otherwise one is
    balanced from its measured counts (so counts measured at ep=1 serve any ep). Layers the
    file does not name keep the contiguous placement.
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read expert placement file {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"expert placement file {path} is not JSON: {exc.msg} at line {exc.lineno}") from exc
    if not isinstance(data, dict) or data.get("kind") != ROUTING_FILE_KIND:
        raise ValueError(f"{path} is not an expert routing file (no \"kind\": \"{ROUTING_FILE_KIND}\")")
    if int(data.get("num_experts", -1)) != num_experts:
        raise ValueError(f"{path} is for {data.get('num_experts')} experts per layer, the model has {num_experts}")
    out = {}
    if int(data.get("ep", 0)) == ep and data.get("placement"):
        for layer, owner in data["placement"].items():
            out[int(layer)] = ExpertPlacement(tuple(int(o) for o in owner), ep)
        return out
    if not data.get("counts"):
        raise ValueError(f"{path} has a placement for ep={data.get('ep')} and no counts to balance for ep={ep}")
    for layer, row in data["counts"].items():
        if len(row) != num_experts:
            raise ValueError(f"{path}: layer {layer} has {len(row)} counts, the model has {num_experts} experts")
        out[int(layer)] = ExpertPlacement(tuple(balanced_placement(row, ep)), ep)
    return out


# -- statistics -----------------------------------------------------------------------------------

class RoutingStats:
    """One MoE layer's routing, step by step: tokens per expert, per rank, imbalance; time per phase.

    Counts are (token, expert) pairs over the whole ep group, identical on every rank of it.
    """

    def __init__(self, placement: ExpertPlacement, history: int = 1024):
        self.placement = placement
        self.history: deque = deque(maxlen=history)  # per step: tokens per rank
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.expert_tokens = torch.zeros(self.placement.num_experts, dtype=torch.float64)
        self.imbalance_sum = 0.0
        self.imbalance_max = 0.0
        self.last: Optional[dict] = None
        self.time_s = {p: 0.0 for p in PHASES}
        self.history.clear()

    def record(self, expert_counts: torch.Tensor) -> None:
        """One step's tokens per expert [E] (summed over the ep group)."""
        counts = expert_counts.to(torch.float64)
        per_rank = self.placement.rank_loads(counts.tolist())
        ratio = imbalance(per_rank)
        self.steps += 1
        self.expert_tokens += counts
        self.imbalance_sum += ratio
        self.imbalance_max = max(self.imbalance_max, ratio)
        self.last = {"tokens_per_expert": counts.tolist(), "tokens_per_rank": per_rank, "imbalance": ratio}
        self.history.append(per_rank)

    @property
    def rank_tokens(self) -> list[float]:
        return self.placement.rank_loads(self.expert_tokens.tolist())

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "tokens_per_expert": self.expert_tokens.tolist(),
            "tokens_per_rank": self.rank_tokens,
            "imbalance": imbalance(self.rank_tokens),
            "step_imbalance_mean": self.imbalance_sum / self.steps if self.steps else 1.0,
            "step_imbalance_max": self.imbalance_max if self.steps else 1.0,
            "placement": list(self.placement.owner),
            "time_s": dict(self.time_s),
        }


# -- the layer ------------------------------------------------------------------------------------

class ParallelExperts(nn.Module):
    """The SwiGLU experts this rank owns, each with its intermediate dimension split over tp.

    Weights are stacked per local expert: w13 [E_local, 2 * I/tp, H] (gate rows, then up rows)
    and w2 [E_local, H, I/tp]. Loaders take the full HF tensor of one expert, or HF's fused
    3-D tensors, and read only this rank's slice of it.
    """

    def __init__(self, placement: ExpertPlacement, ep_rank: int, hidden: int, intermediate: int, tp: Communicator,
                 dtype: torch.dtype, name: str):
        super().__init__()
        self.name, self.hidden, self.intermediate = name, hidden, intermediate
        self.experts = placement.local_experts(ep_rank)
        self.local_index = {e: j for j, e in enumerate(self.experts)}
        self.i_start, self.i_local = shard_range(intermediate, tp.size, tp.rank, f"{name}: expert intermediate size")
        n = len(self.experts)
        self.w13 = nn.Parameter(torch.empty(n, 2 * self.i_local, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, hidden, self.i_local, dtype=dtype), requires_grad=False)

    def _rows(self, source, rows: int, expert: Optional[int] = None) -> torch.Tensor:
        """This rank's intermediate rows of a [I, H] source (or of expert `expert` of an [E, I', H] one)."""
        index = (slice(self.i_start + rows, self.i_start + rows + self.i_local), slice(None))
        if expert is None:
            return source[index]
        return source[(slice(expert, expert + 1),) + index][0]

    def load_expert(self, expert: int, gate, up, down) -> None:
        """One expert from its own tensors: gate/up [I, H] (Mixtral w1/w3), down [H, I] (w2)."""
        j, I, H = self.local_index[expert], self.intermediate, self.hidden
        for part, source in enumerate((gate, up)):
            label = f"{self.name}.{expert}.{'gate' if part == 0 else 'up'}"
            check_shape(label, source, (I, H))
            copy_into(self.w13[j, part * self.i_local:(part + 1) * self.i_local], self._rows(source, 0), label)
        check_shape(f"{self.name}.{expert}.down", down, (H, I))
        copy_into(self.w2[j], down[:, self.i_start:self.i_start + self.i_local], f"{self.name}.{expert}.down")

    def load_fused(self, gate_up, down, num_experts: int) -> None:
        """From transformers' fused tensors: gate_up [E, 2I, H] (gate rows first), down [E, H, I]."""
        I, H = self.intermediate, self.hidden
        check_shape(f"{self.name}.gate_up_proj", gate_up, (num_experts, 2 * I, H))
        check_shape(f"{self.name}.down_proj", down, (num_experts, H, I))
        for j, e in enumerate(self.experts):
            for part in (0, 1):
                copy_into(self.w13[j, part * self.i_local:(part + 1) * self.i_local], self._rows(gate_up, part * I, e),
                          f"{self.name}.gate_up_proj[{e}]")
            down_rows = down[e:e + 1, :, self.i_start:self.i_start + self.i_local][0]
            copy_into(self.w2[j], down_rows, f"{self.name}.down_proj[{e}]")

    def forward(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Expert `local_ids[i]` applied to `rows[i]`; un-reduced over tp."""
        order = torch.argsort(local_ids, stable=True)
        sizes = torch.bincount(local_ids, minlength=len(self.experts)).tolist()
        grouped = rows[order]
        out = torch.empty_like(grouped)
        start = 0
        for j, n in enumerate(sizes):
            if n:
                gate, up = F.linear(grouped[start:start + n], self.w13[j]).chunk(2, dim=-1)
                out[start:start + n] = F.linear(F.silu(gate) * up, self.w2[j])
            start += n
        result = torch.empty_like(out)
        result[order] = out
        return result


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
