"""The rates one rank of a layout computes and moves data at on a hardware profile: GEMMs, attention,
the KV cache's reads and each collective over its group's links (where the group sits on the nodes)."""

from __future__ import annotations

import math
from typing import Optional

from dist_infer.planner.hardware import HardwareProfile, Link
from dist_infer.planner.layout import Layout
from dist_infer.planner.shapes import ModelShape, linear_flops
from dist_infer.planner.workload import Schedule
from dist_infer.topology.mesh import RANK_ORDER

MESH_ORDER = tuple(a for a in RANK_ORDER if a != "dp")  # the mesh's rank order, fastest varying first; a plan has dp=1


def group_placement(layout: Layout, axis: str, ranks_per_node: int) -> tuple[bool, int]:
    """(whether an `axis` group spans nodes, how many of its ranks share each node), with ranks
    filling nodes in mesh order."""
    stride = 1
    for a in MESH_ORDER:
        n = getattr(layout, a)
        if a == axis:
            return (n > 1 and stride * n > ranks_per_node), max(1, min(n, ranks_per_node // stride))
        stride *= n
    raise ValueError(axis)


class RankRates:
    """Rates of one rank of `layout` on `hw`, and the links it talks over.

    On a CPU node (shared_node) two views: a rank alone (`node=False`: its own threads, the
    critical path when nothing else runs) and the node's capacity (`node=True`: all cores and the
    node's bandwidth, the overhead's CPU seconds spread over the cores, no waiting counted), so
    that the work of every rank on the node bounds the time from below."""

    def __init__(
        self,
        hw: HardwareProfile,
        layout: Layout,
        sched: Schedule,
        shape: ModelShape,
        node: bool = False,
        busy_stages: int = 1,
    ):
        head_dim, kv_heads = shape.head_dim, shape.heads_per_rank(layout.tp)[1]
        self.hw, self.layout, self.sched, self.node, self.head_dim = hw, layout, sched, node, head_dim
        self.local = min(layout.ranks, sched.ranks_per_node)
        busy = self.local * min(busy_stages, layout.pp) / layout.pp  # ranks computing at once
        self.overhead_scale, self.share, self.oversubscribed = 1.0, 1.0, False
        if hw.shared_node:
            cores = sched.cores_per_node or hw.devices_per_node
            self.oversubscribed = busy > cores
            self.threads = cores if node else max(1, cores // self.local)
            self.overhead_scale = 1.0 / cores if node else 1.0
            if self.oversubscribed and not node and layout.tp * layout.cp * layout.ep > 1:
                # ranks that meet at a collective every layer cannot take turns on a core: each
                # runs at its share of one, waiting peers spin on theirs (pp stages with work at
                # once count; the others take turns, which the node view bounds)
                self.share = cores / busy
        else:
            self.threads = 1
        self.kv_heads = kv_heads
        self.bw = hw.bandwidth(self.threads) * self.share

    def kv_rate(self, context: float) -> float:
        """Bytes/s this rank's decode attention reads its KV shard at, for `context` tokens per
        sequence on the rank."""
        hw = self.hw
        rate = hw.kv_bandwidth(self.threads, self.head_dim, self.kv_heads, context) * self.share
        if self.node and hw.shared_node and self.local > 1:
            # the node's view: its ranks read their KV shards side by side, each at the rate for its
            # own threads (as many ranks as have a core), up to the node's memory bandwidth
            cores = self.sched.cores_per_node or hw.devices_per_node
            per_rank = max(1, cores // self.local)
            rate = min(
                self.bw,
                min(self.local, cores // per_rank) * hw.kv_bandwidth(per_rank, self.head_dim, self.kv_heads, context),
            )
        return rate

    def gemm(self, flops: float, weight_bytes: float, rows: float, dtype: str, row_length: float = math.inf) -> float:
        """The longer of the FLOPs at the GEMM rate for `rows` rows and the weights streamed at the
        rate for their `row_length` (input features) and their size (a small matrix streams slower:
        its call and the prefetchers' start are paid per matrix)."""
        if flops <= 0:
            return 0.0
        rate = self.hw.gemm_rate(dtype, self.threads, rows) * self.share
        stream = self.hw.bandwidth(self.threads, row_length) * self.hw.size_factor(self.threads, weight_bytes)
        return max(flops / rate, weight_bytes / (stream * self.share))

    def linears(self, matrices: list, rows: float, dtype: str, elem_bytes: float) -> float:
        """`matrices`: [(parameters, row length)] of this rank's weight matrices, each run on `rows` rows."""
        return sum(self.gemm(linear_flops(n, rows), n * elem_bytes, rows, dtype, k) for n, k in matrices if n > 0)

    def attention(
        self, flops: float, kv_bytes: float, rows: float, dtype: str, causal: bool = True, context: float = 4096
    ) -> float:
        """The longer of the FLOPs at the attention rate and the KV cache read at the rate for
        `context` tokens per sequence (decode)."""
        if flops <= 0:
            return 0.0
        rate = self.hw.attention_rate(dtype, self.threads, rows, self.head_dim, causal) * self.share
        return max(flops / rate, kv_bytes / self.kv_rate(context) if kv_bytes > 0 else 0.0)

    def collective(
        self, op: str, axis: str, nbytes: float, fixed: Optional[float] = None, latency_counted: bool = False
    ) -> float:
        """Seconds for `op` over this rank's `axis` group; `fixed` replaces the link's latency
        (a measured fixed cost that already holds it); `latency_counted`: only the bytes (the
        layout's measured fixed costs hold every latency and wait)."""
        n = getattr(self.layout, axis)
        if n <= 1 or nbytes <= 0 or self.node:  # the node view counts work, not waiting
            return 0.0
        if latency_counted:
            fixed = 0.0
        spans, per_node = group_placement(self.layout, axis, self.sched.ranks_per_node)
        scope = (
            "inter"
            if spans
            else ("shm" if (axis == "tp" and op == "all_reduce" and self.hw.device == "cpu") else "intra")
        )
        factor = {
            "all_reduce": 2.0 * (n - 1) / n,
            "all_gather": (n - 1) / n,
            "all_to_all": (n - 1) / n,
            "send_recv": 1.0,
        }[op]
        link = self.hw.link(op, n, scope)
        if self.oversubscribed:
            # ranks outnumber the cores: every collective also waits for its peers to get a core
            if scope + "-over" in self.hw.collectives.get(op, {}):
                link = Link(link.latency_s, self.hw.link(op, n, scope + "-over").busbw)
            link = Link(link.latency_s + self.hw.sync_oversubscribed_s, link.busbw)
            if fixed is not None and not latency_counted:
                fixed += self.hw.sync_oversubscribed_s
        if spans and per_node > 1 and op != "send_recv":
            # NCCL runs one ring per NIC (rail): the group's ranks on a node cross between nodes in
            # parallel, each on its own NIC, so the bus bandwidth is theirs together, up to the node's links
            intra = self.hw.link(op, n, "intra")
            link = Link(link.latency_s, min(intra.busbw, link.busbw * per_node))
        if fixed is not None:
            link = Link(fixed, link.busbw)
        return link.time(nbytes, factor)
