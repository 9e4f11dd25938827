"""A hardware profile: what one rank can compute and move, as the cost model needs it.

A profile is a JSON file, either measured on this machine (`dist-infer calibrate`) or built
from published figures for hardware we cannot reach (`profiles/*.json`, each figure with its
source). Rates are per rank: one GPU, or one CPU process with its share of the node's cores.

Rates may depend on how many threads a rank runs and on the GEMM's row count, so a rate is
either a number or a table `{threads: [[rows, value], ...]}` (CPU profiles measure both).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Union

PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles")

Rate = Union[float, dict]


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Link:
    """One collective on one kind of link: fixed latency plus bytes over bus bandwidth."""

    latency_s: float
    busbw: float  # bytes/s, nccl-tests' bus bandwidth convention

    def time(self, nbytes: float, factor: float) -> float:
        """Seconds for a buffer of `nbytes` whose traffic per rank is `factor` x nbytes."""
        return self.latency_s + factor * nbytes / self.busbw


@dataclass
class HardwareProfile:
    name: str
    device: str  # "cpu" or "cuda"
    gemm_flops: dict  # dtype -> Rate (FLOP/s per rank)
    attention_flops: dict  # dtype -> Rate (FLOP/s per rank for prefill attention, causal)
    memory_bandwidth: Rate  # bytes/s per rank streaming weights (calibrated: by the weights' row length)
    memory_bytes: float  # capacity per rank (a GPU's memory; a CPU node's memory / ranks)
    devices_per_node: int  # GPUs per node, or cores per CPU node
    links: dict  # "intra" / "inter" -> Link: every collective on that link unless `collectives` says otherwise
    collectives: dict = field(default_factory=dict)  # op -> {"intra"|"inter"|"shm": {group size: Link}}
    # KV bytes/s a decode's attention reads, by head_dim, the rank's KV heads and the context (0: memory_bandwidth)
    decode_attention_bandwidth: Rate = 0.0
    # {threads: [[matrix bytes, factor]]}: a matrix of that size streams at `factor` times the rate of
    # the large ones memory_bandwidth has (below 1 for small matrices: the call, waking a thread and
    # the prefetchers' start are paid per matrix; e.g. docs/profiles/cpu2-vm.json); {}: 1 at every size
    stream_size_factor: dict = field(default_factory=dict)
    per_layer_s: float = 0.0  # fixed time per decoder layer per step (kernel launches, Python)
    per_step_s: float = 0.0  # fixed time per engine step (scheduling, sampling, the plan)
    base_memory_bytes: float = 0.0  # a rank's memory before the model (runtime, CUDA context)
    shared_node: bool = False  # CPU: ranks on a node share its cores and memory bandwidth
    comm_overlaps_compute: bool = True  # False: a transfer needs the cores the compute uses (CPU), nothing hides
    cp_step_s: float = 0.0  # fixed cost of one ring step per layer (post, wait, merge); 0: the link's latency
    cp_decode_layer_s: float = 0.0  # fixed cost per layer of a cp decode's merge (gather + LSE math); 0: latency
    sync_oversubscribed_s: float = 0.0  # CPU: what each collective costs when a node's ranks outnumber its cores
    # layout ("tp=2,cp=2") -> {"per_layer_s", "per_step_s"}: a decode step's fixed costs timed in that
    # very layout (calibrate, on a narrow model): every collective's latency, the pp hand-overs, the cp
    # merge, ranks waiting for a core, as they add up inside the step loop. Where a layout has them,
    # decode counts these instead of the per-op latencies above, and only bytes over the links.
    decode_fixed: dict = field(default_factory=dict)
    # layout -> {"per_layer_s", "per_step_s"}: the same for a prefill (the narrow model's time to
    # first token against its depth): the ring's steps, the all-reduces and hand-overs as they wait
    prefill_fixed: dict = field(default_factory=dict)
    # dtype -> Rate of attention without a mask (a cp ring's blocks off the diagonal: faster than the
    # causal rate at the same length on a CPU, e.g. docs/profiles/cpu2-vm.json); {}: the causal rate
    attention_flops_full: dict = field(default_factory=dict)
    # calibrate's `measure_reference` when the profile was measured: {"threads", "gemm_flops", "stream_bandwidth"}
    reference: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)
    notes: str = ""

    # -- lookups -----------------------------------------------------------------------------
    def gemm_rate(self, dtype: str, threads: int = 1, rows: float = math.inf) -> float:
        return _lookup(self.gemm_flops, dtype, threads, rows, self.name, "gemm_flops")

    def attention_rate(
        self, dtype: str, threads: int = 1, rows: float = math.inf, head_dim: int = 128, causal: bool = True
    ) -> float:
        """FLOP/s of a causal prefill's attention over `rows` tokens (`causal=False`: a block with no
        mask, where the profile has it). A calibrated profile has it by head size too (larger heads
        run faster: e.g. docs/profiles/cpu2-vm.json)."""
        if not causal and dtype in self.attention_flops_full:
            return _lookup(self.attention_flops_full, dtype, threads, rows, self.name, "attention_flops_full", head_dim)
        return _lookup(self.attention_flops, dtype, threads, rows, self.name, "attention_flops", head_dim)

    def bandwidth(self, threads: int = 1, row_length: float = math.inf) -> float:
        """Bytes/s a decode's few-row product streams weights at. A calibrated profile has it by the
        matrix's row length (its input features): the kernel's speed depends on it (long rows
        stream slower: e.g. docs/profiles/cpu2-vm.json); without one, the widest row's rate (that of
        memory-bound work other than a GEMM)."""
        return _rate_at(self.memory_bandwidth, threads, row_length)

    def kv_bandwidth(self, threads: int = 1, head_dim: int = 128, kv_heads: int = 1, context: float = 4096) -> float:
        """Bytes/s of KV cache a decode step's attention reads. Its kernel's speed depends on the
        head size, on how many KV heads the rank holds (one KV head is read in one run, several are
        interleaved in the cache's rows) and on the context (the kernel's chunks, and a sequence's
        cache outgrowing the CPU's caches; docs/benchmarks.md, "Decode attention at long contexts:
        the chunked kernel"). A calibrated profile has it as {threads:
        {head_dim: {kv_heads: [[context, rate]]}}}; profiles from before as {threads: {head_dim:
        [[kv_heads, rate]]}} (any context) or {threads: [[head_dim, rate]]} (any heads)."""
        rate = self.decode_attention_bandwidth
        if not rate:
            return self.bandwidth(threads)
        if isinstance(rate, dict) and all(isinstance(v, dict) for v in rate.values()):

            def at_head_size(by_heads) -> float:
                if isinstance(by_heads, dict):  # {kv_heads: [[context, rate]]}
                    return interpolate_log([[float(k), _curve_at(c, context)] for k, c in by_heads.items()], kv_heads)
                return _curve_at(by_heads, kv_heads)

            curves = _at_threads(rate, threads)
            return interpolate_log([[float(d), at_head_size(c)] for d, c in curves.items()], head_dim)
        return _rate_at(rate, threads, head_dim)

    def size_factor(self, threads: int, nbytes: float) -> float:
        """How fast a matrix of `nbytes` streams against the large ones the bandwidth is for."""
        return _rate_at(self.stream_size_factor, threads, nbytes) if self.stream_size_factor else 1.0

    def link(self, op: str, group_size: int, scope: str) -> Link:
        """The Link an `op` over `group_size` ranks uses: measured for that op and scope when the
        profile has it (nearest measured group size), else the scope's link."""
        measured = self.collectives.get(op, {}).get(scope)  # {"2": Link, "4": Link}
        if measured:
            n = min((int(k) for k in measured), key=lambda s: (abs(s - group_size), -s))
            return measured[str(n)]
        if scope == "shm":
            scope = "intra"
        if scope not in self.links:
            raise ProfileError(f"profile {self.name}: no {scope!r} link")
        return self.links[scope]

    def at_speed(self, compute: float, memory: float) -> "HardwareProfile":
        """This machine running `compute` times as fast as when it was profiled (FLOP rates up, and
        every fixed cost, which is CPU time, down) and streaming memory `memory` times as fast
        (weights, KV, the links' bytes): what a shared machine is at another moment."""

        def scale(rate, by: float):
            if isinstance(rate, (int, float)):
                return rate * by
            if isinstance(rate, dict):
                return {k: scale(v, by) for k, v in rate.items()}
            return [[x, y * by] for x, y in rate]  # a curve: [[rows | row length | head size, rate]]

        def link(l: Link) -> Link:
            return Link(l.latency_s / compute, l.busbw * memory)

        def per_layout(costs: dict) -> dict:  # layout -> {fixed cost: seconds}
            return {k: {kk: vv / compute for kk, vv in v.items()} for k, v in costs.items()}

        return replace(
            self,
            gemm_flops=scale(self.gemm_flops, compute),
            attention_flops=scale(self.attention_flops, compute),
            attention_flops_full=scale(self.attention_flops_full, compute),
            memory_bandwidth=scale(self.memory_bandwidth, memory),
            decode_attention_bandwidth=scale(self.decode_attention_bandwidth, memory),
            links={k: link(v) for k, v in self.links.items()},
            collectives={
                op: {sc: {n: link(l) for n, l in by_n.items()} for sc, by_n in scopes.items()}
                for op, scopes in self.collectives.items()
            },
            per_layer_s=self.per_layer_s / compute,
            per_step_s=self.per_step_s / compute,
            cp_step_s=self.cp_step_s / compute,
            cp_decode_layer_s=self.cp_decode_layer_s / compute,
            sync_oversubscribed_s=self.sync_oversubscribed_s / compute,
            decode_fixed=per_layout(self.decode_fixed),
            prefill_fixed=per_layout(self.prefill_fixed),
        )

    # -- files -------------------------------------------------------------------------------
    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("links", "collectives")}
        out["links"] = {k: vars(v) for k, v in self.links.items()}
        out["collectives"] = {
            op: {scope: {str(n): vars(link) for n, link in by_n.items()} for scope, by_n in scopes.items()}
            for op, scopes in self.collectives.items()
        }
        return out

    @classmethod
    def from_json(cls, data: dict, source: str = "<profile>") -> "HardwareProfile":
        need = (
            "name",
            "device",
            "gemm_flops",
            "attention_flops",
            "memory_bandwidth",
            "memory_bytes",
            "devices_per_node",
            "links",
        )
        missing = [k for k in need if k not in data]
        if missing:
            raise ProfileError(f"{source}: missing field(s) {', '.join(missing)}")
        try:
            links = {k: Link(float(v["latency_s"]), float(v["busbw"])) for k, v in data["links"].items()}
            collectives = {
                op: {
                    scope: {str(n): Link(float(v["latency_s"]), float(v["busbw"])) for n, v in by_n.items()}
                    for scope, by_n in scopes.items()
                }
                for op, scopes in data.get("collectives", {}).items()
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"{source}: a link needs latency_s and busbw numbers ({exc})") from None
        known = {f.name for f in fields(cls)}
        rest = {k: v for k, v in data.items() if k in known and k not in ("links", "collectives")}
        return cls(links=links, collectives=collectives, **rest)


def _rate_at(rate: Rate, threads: int, rows: float, head_dim: float = 128) -> float:
    """A rate: one number, or by thread count (the most threads up to `threads`) a number, a curve
    [[rows, rate], ...], or curves by head size {head_dim: curve} (interpolated between head sizes)."""
    if isinstance(rate, (int, float)):
        return float(rate)
    curve = _at_threads(rate, threads)
    if isinstance(curve, dict):
        return interpolate_log([[float(d), _curve_at(c, rows)] for d, c in curve.items()], head_dim)
    return _curve_at(curve, rows)


def _at_threads(rate: dict, threads: int):
    """A by-thread-count table's entry for the most threads up to `threads` (else the fewest)."""
    by_threads = {int(k): v for k, v in rate.items()}
    return by_threads[max((k for k in by_threads if k <= threads), default=min(by_threads))]


def _curve_at(curve, x: float) -> float:
    return float(curve) if isinstance(curve, (int, float)) else interpolate_log(curve, x)


def interpolate_log(points: list, x: float) -> float:
    """Piecewise-linear in log(x) through sorted [x, y] points, flat beyond the ends."""
    pts = sorted((float(a), float(b)) for a, b in points)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return pts[-1][1]


def _lookup(table: dict, dtype: str, threads: int, rows: float, name: str, what: str, head_dim: float = 128) -> float:
    if dtype not in table:
        raise ProfileError(f"profile {name}: {what} has no {dtype!r} entry (it has {', '.join(sorted(table))})")
    return _rate_at(table[dtype], threads, rows, head_dim)


def builtin_profiles() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


def load_profile(spec: str) -> HardwareProfile:
    """A built-in profile by name (e.g. `h100-sxm`) or a JSON file written by `dist-infer calibrate`."""
    path = spec if os.path.exists(spec) else os.path.join(PROFILE_DIR, f"{spec}.json")
    if not os.path.exists(path):
        raise ProfileError(
            f"no hardware profile {spec!r}: not a file, and not one of the built-in profiles "
            f"({', '.join(builtin_profiles())}); make one with `dist-infer calibrate --out FILE`"
        )
    try:
        with open(path) as f:
            data: Any = json.load(f)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a profile is a JSON object")
    return HardwareProfile.from_json(data, source=path)


def save_profile(profile: HardwareProfile, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(profile.to_json(), f, indent=1)
        f.write("\n")
