"""What `dist-infer comm-test` runs (cli/comm_test_cmd.py): every op on every group at several sizes,
checked and timed.

Each rank fills its buffers with values derived from its global rank (`pattern`), so the
result every op must produce is computed locally from the group's rank list alone: an
independent check that does not trust the communicator under test. Timings follow the
nccl-tests convention (algbw = bytes / time, busbw = algbw x an op-dependent factor).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import torch
from loguru import logger

from dist_infer.comm.base import Communicator, P2POp
from dist_infer.comm.groups import ParallelGroups

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv", "batch_p2p", "barrier")
DEFAULT_SIZES = (4 << 10, 256 << 10, 4 << 20)


def bus_bandwidth_factor(op: str, n: int) -> float:
    """nccl-tests' busbw factor: busbw = algbw x factor, comparable to the link speed."""
    if n <= 1 or op == "barrier":
        return 0.0 if op == "barrier" else 1.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # broadcast, send/recv


def pattern(global_rank: int, numel: int, salt: int = 0) -> torch.Tensor:
    """A rank's deterministic payload: small integers, exact in fp32 sums over thousands of ranks."""
    i = torch.arange(numel, dtype=torch.float32)
    return (i % 251) + 256.0 * (global_rank + 1) + 17.0 * salt


def a2a_rows(src: int, dst: int) -> int:
    """Rows group rank `src` sends to `dst` in the all-to-all check: unequal, some zero."""
    return (src + dst) % 3


def _added(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts added up in order (sum() of tensors, typed: a group has at least one rank)."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def expected(op: str, ranks: Sequence[int], me: int, numel: int) -> torch.Tensor:
    """What group rank `me` must hold after `op` among global `ranks`, computed without communicating."""
    n = len(ranks)
    if op == "all_reduce":
        return _added([pattern(r, numel) for r in ranks])
    if op == "all_gather":
        return torch.cat([pattern(r, numel // n) for r in ranks])
    if op == "reduce_scatter":
        chunk = numel // n
        return _added([pattern(r, chunk * n) for r in ranks])[me * chunk : (me + 1) * chunk]
    if op == "all_to_all":
        width = a2a_width(numel, n)
        return torch.cat([a2a_block(ranks[src], ranks[me], a2a_rows(src, me), width) for src in range(n)])
    if op == "broadcast":
        return pattern(ranks[0], numel)
    if op in ("send_recv", "batch_p2p"):
        return pattern(ranks[(me - 1) % n], numel)
    raise ValueError(op)


def a2a_width(numel: int, n: int) -> int:
    return max(1, numel // max(1, sum(a2a_rows(0, j) for j in range(n))))


def a2a_block(src_global: int, dst_global: int, rows: int, width: int) -> torch.Tensor:
    return pattern(src_global, rows * width, salt=dst_global).view(rows, width)


@dataclass
class Result:
    op: str
    group: str
    bytes: int
    latency_us: float
    busbw_gbps: float
    ok: bool


class _Case:
    """Buffers for one op on one group at one size; `run` posts it, `check` verifies."""

    def __init__(self, op: str, comm: Communicator, numel: int):
        self.op, self.comm = op, comm
        n, me, ranks = comm.size, comm.rank, comm.ranks
        g = ranks[me]
        self.numel = numel
        if op == "all_reduce":
            self.src = pattern(g, numel)
            self.out = self.src.clone()
        elif op == "all_gather":
            self.src = pattern(g, numel // n)
            self.out = torch.empty(numel // n * n)
        elif op == "reduce_scatter":
            self.src = pattern(g, numel // n * n)
            self.out = torch.empty(numel // n)
        elif op == "all_to_all":
            width = a2a_width(numel, n)
            self.in_splits = [a2a_rows(me, j) for j in range(n)]
            self.out_splits = [a2a_rows(i, me) for i in range(n)]
            self.src = torch.cat([a2a_block(g, ranks[j], self.in_splits[j], width) for j in range(n)])
            self.out = torch.empty(sum(self.out_splits), width)
        elif op == "broadcast":
            self.src = pattern(g, numel)
            self.out = self.src.clone()
        elif op in ("send_recv", "batch_p2p"):
            self.src = pattern(g, numel)
            self.out = torch.empty(numel)
        else:
            self.src = self.out = torch.empty(0)
        # Nominal size, identical on every rank (all_to_all rows differ per rank by design).
        self.nbytes = (
            0 if op == "barrier" else (numel // n * n if op in ("all_gather", "reduce_scatter") else numel) * 4
        )

    def reset(self) -> None:
        if self.op in ("all_reduce", "broadcast"):
            self.out.copy_(self.src)
        else:
            self.out.zero_()

    def run(self, async_op: bool):
        c, op = self.comm, self.op
        if op == "all_reduce":
            return c.all_reduce(self.out, async_op=async_op)
        if op == "all_gather":
            return c.all_gather(self.out, self.src, async_op=async_op)
        if op == "reduce_scatter":
            return c.reduce_scatter(self.out, self.src, async_op=async_op)
        if op == "all_to_all":
            return c.all_to_all(self.out, self.src, self.out_splits, self.in_splits, async_op=async_op)
        if op == "broadcast":
            return c.broadcast(self.out, src=0, async_op=async_op)
        if op == "barrier":
            return c.barrier(async_op=async_op)
        nxt, prv = (c.rank + 1) % c.size, (c.rank - 1) % c.size
        if op == "send_recv":
            # Blocking pairs in an order that cannot deadlock: even ranks send first.
            if c.size == 1:
                self.out.copy_(self.src)
            elif c.rank % 2 == 0:
                c.send(self.src, nxt)
                c.recv(self.out, prv)
            else:
                c.recv(self.out, prv)
                c.send(self.src, nxt)
            return None
        handle = c.batch_isend_irecv([P2POp("send", self.src, nxt), P2POp("recv", self.out, prv)])
        if async_op:
            return handle
        handle.wait(c.timeout)
        return None

    def check(self) -> bool:
        if self.op == "barrier":
            return True
        want = expected(self.op, self.comm.ranks, self.comm.rank, self.numel).reshape(self.out.shape)
        return bool(torch.equal(self.out, want))


def _iterations(nbytes: int, iters: Optional[int]) -> int:
    if iters:
        return iters
    return int(max(5, min(50, (8 << 20) // max(1, nbytes))))


def run_case(
    op: str, name: str, comm: Communicator, world: Communicator, numel: int, iters: Optional[int], warmup: int
) -> Result:
    """Run `op` on `comm` (all groups of an axis at once); every world rank takes part."""
    case = _Case(op, comm, numel)
    # Correctness, blocking form.
    case.reset()
    case.run(async_op=False)
    ok = case.check()
    n_iter = _iterations(case.nbytes, iters)
    elapsed = 0.0
    for i in range(warmup + n_iter):
        case.reset()
        t0 = time.perf_counter()
        handle = case.run(async_op=True)
        if handle is not None:
            handle.wait()
        if i >= warmup:
            elapsed += time.perf_counter() - t0
    ok = ok and case.check()  # correctness, async form
    stats = torch.tensor([elapsed / n_iter, 0.0 if ok else 1.0], dtype=torch.float64)
    world.all_reduce(stats, op="max")
    latency = float(stats[0])
    all_ok = bool(stats[1] == 0.0)
    busbw = case.nbytes / latency * bus_bandwidth_factor(op, comm.size) / 1e9 if latency > 0 else 0.0
    return Result(op, name, case.nbytes, latency * 1e6, busbw, all_ok)


def groups_to_test(groups: ParallelGroups) -> list[tuple[str, Communicator]]:
    """The world, then every axis whose groups are neither trivial nor the world itself."""
    out = [("world", groups.world)]
    for axis, comm in groups.by_axis().items():
        if comm.size > 1 and comm is not groups.world:
            out.append((axis, comm))
    return out


def run_comm_test(
    groups: ParallelGroups,
    sizes: Sequence[int] = DEFAULT_SIZES,
    ops: Sequence[str] = OPS,
    iters: Optional[int] = None,
    warmup: int = 2,
    progress: Optional[Callable[[Result], None]] = None,
) -> list[Result]:
    results = []
    for name, comm in groups_to_test(groups):
        for op in ops:
            for nbytes in [0] if op == "barrier" else sizes:
                numel = max(comm.size, nbytes // 4)
                result = run_case(op, name, comm, groups.world, numel, iters, warmup)
                if not result.ok:
                    logger.error(f"{op} on {name} at {result.bytes} bytes gave a wrong result")
                results.append(result)
                if progress:
                    progress(result)
    return results


def format_table(results: Sequence[Result]) -> str:
    head = f"{'op':<15}{'group':<7}{'bytes':>10}{'latency_us':>13}{'busbw_GB/s':>12}  ok"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.op:<15}{r.group:<7}{r.bytes:>10}{r.latency_us:>13.1f}{r.busbw_gbps:>12.3f}  {'yes' if r.ok else 'NO'}"
        )
    return "\n".join(lines)


def results_json(results: Sequence[Result], world_size: int, backend: str) -> dict:
    return {
        "ok": all(r.ok for r in results),
        "world_size": world_size,
        "backend": backend,
        "results": [asdict(r) for r in results],
    }
