"""Ring attention as a real multi-process job, checked against single-rank attention.

Every rank builds the same seeded full-sequence q, k, v, computes the single-rank reference
in fp64 by the definition (scores, mask by original positions, softmax), takes its own rows
(zigzag, or a cached prefix spread over the ranks) and runs the ring over the cp group. Each
rank checks its own rows: fp64 within 1e-10, fp32 within 1e-5, pass-KV and pass-Q agreeing.
Any failed check raises, and `run_rank_command` ends the job (non-zero exit, MPI abort).

usage: python ring_attention_job.py [--backend gloo|mpi] [--fail-at-step K] [--quick]
       python ring_attention_job.py --time TOKENS [--device cpu|cuda] [--dtype float32|bfloat16]
  --fail-at-step K: cp rank 1 raises at its K-th ring transfer (the others are then waiting
                    inside the ring: the launcher or MPI must end the job).
  --time TOKENS:    no checks; time one pass-KV ring over a TOKENS-token sequence (8 heads, 4 KV
                    heads, head_dim 32) and print each rank's attention FLOP/s (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dist_infer.comm import build_groups, init_world
from dist_infer.comm.delegating import DelegatingCommunicator
from dist_infer.launch.rank import run_rank_command
from dist_infer.models.rope import Rotary, apply_rotary
from dist_infer.parallel.ring.blocks import ring_step_flops
from dist_infer.parallel.ring.layout import RingLayout
from dist_infer.parallel.ring.ring_loops import ring_attention, ring_attention_pass_kv, ring_attention_pass_q
from dist_infer.parallel.ring.shards import zigzag_chunks
from dist_infer.topology import Layout, Mesh

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


class FailingRing(DelegatingCommunicator):
    """Raises on this rank's `fail_at`-th ring transfer, as a rank that breaks mid-ring would."""

    def __init__(self, inner, fail_at: int):
        super().__init__(inner)
        self.fail_at, self.calls = fail_at, 0

    def batch_isend_irecv(self, ops):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"injected failure at ring transfer {self.calls} on cp rank {self.rank}")
        return self.inner.batch_isend_irecv(ops)


def reference(q, k, v, q_pos, k_pos, causal, q_seq=None, k_seq=None):
    """fp64 attention by the definition: query i sees key j iff same sequence and (not causal or pos_j <= pos_i)."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * HEAD_DIM**-0.5
    keep = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    if causal:
        keep &= torch.tensor(q_pos)[:, None] >= torch.tensor(k_pos)[None, :]
    if q_seq is not None:
        keep &= torch.tensor(q_seq)[:, None] == torch.tensor(k_seq)[None, :]
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vv), lse.transpose(0, 1)


def check(what, got, want, dtype, rank):
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    if not err <= TOL[dtype]:
        raise AssertionError(f"cp rank {rank}: {what}: max error {err:.3g} > {TOL[dtype]:g}")


def fresh_case(cp, seq_lens, causal, dtype, rope: Rotary):
    """A batch of fresh sequences, zigzag split; RoPE applied on each rank from the original positions."""
    me, n = cp.rank, cp.size
    gen = torch.Generator().manual_seed(1000 + sum(seq_lens) + 7 * causal)
    total = sum(seq_lens)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    pos = [p for n_ in seq_lens for p in range(n_)]
    seq = [s for s, n_ in enumerate(seq_lens) for _ in range(n_)]
    cos, sin = rope.cos_sin(torch.tensor(pos))
    q_rot, k_rot = apply_rotary(q, cos.double(), sin.double()), apply_rotary(k, cos.double(), sin.double())
    want, want_lse = reference(q_rot, k_rot, v, pos, pos, causal, seq, seq)
    # this rank's rows: each sequence's zigzag shard, in batch order
    starts = [sum(seq_lens[:s]) for s in range(len(seq_lens))]
    rows = [starts[s] + p for s, n_ in enumerate(seq_lens) for p in zigzag_chunks(n_, n, me).positions]
    local_pos = torch.tensor([pos[r] for r in rows], dtype=torch.long)
    cos_l, sin_l = rope.cos_sin(local_pos)
    q_l = apply_rotary(q[rows], cos_l.double(), sin_l.double()).to(dtype)  # RoPE from the original positions
    k_l = apply_rotary(k[rows], cos_l.double(), sin_l.double()).to(dtype)
    layout = RingLayout.zigzag(seq_lens, n)
    outs = {}
    for variant in ("pass-kv", "pass-q"):
        o, lse = ring_attention(q_l, k_l, v[rows].to(dtype), cp, layout, variant, causal=causal)
        assert o.dtype == dtype and tuple(o.shape) == (len(rows), HEADS, HEAD_DIM)
        tag = f"fresh {seq_lens} causal={causal} {dtype} {variant}"
        check(tag, o, want[rows], dtype, me)
        check(tag + " lse", lse, want_lse[rows], dtype, me)
        outs[variant] = o
    check(f"fresh {seq_lens} causal={causal} {dtype} pass-kv vs pass-q", outs["pass-kv"], outs["pass-q"], dtype, me)
    return 2


def cached_case(cp, cached, new, dtype):
    """New tokens after a cached prefix: the prefix's K/V spread round-robin, the new tokens zigzag.

    Layouts come from `RingLayout.gather` (each rank knows only its own positions) and the
    ranks' key counts differ, so the ring pads its buffers.
    """
    me, n = cp.rank, cp.size
    gen = torch.Generator().manual_seed(2000 + cached + new)
    total = cached + new
    q = torch.randn(new, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    want, _ = reference(q, k, v, list(range(cached, total)), list(range(total)), True)
    mine_new = [cached + p for p in zigzag_chunks(new, n, me).positions]
    mine_keys = [p for p in range(cached) if p % n == me] + mine_new  # round-robin cached, then the new ones
    q_pos, k_pos = torch.tensor(mine_new), torch.tensor(mine_keys)
    layout = RingLayout.gather(cp, q_pos, k_pos)
    q_l = q[[p - cached for p in mine_new]].to(dtype)
    k_l, v_l = k[mine_keys].to(dtype), v[mine_keys].to(dtype)
    rows = [p - cached for p in mine_new]
    o_kv, _ = ring_attention_pass_kv(q_l, k_l, v_l, cp, layout)
    o_q, _ = ring_attention_pass_q(q_l, k_l, v_l, cp, layout)
    tag = f"cached {cached} + new {new} {dtype}"
    check(tag + " pass-kv", o_kv, want[rows], dtype, me)
    check(tag + " pass-q", o_q, want[rows], dtype, me)
    check(tag + " pass-kv vs pass-q", o_kv, o_q, dtype, me)
    return 2


def time_ring(cp, tokens: int, device: str, dtype: torch.dtype) -> None:
    """Best of 3 pass-KV rings: FLOP/s per rank of wall time and of this process's CPU time."""
    heads, kv_heads, d = 8, 4, 32
    layout = RingLayout.zigzag([tokens], cp.size)
    n = layout.q_rows[cp.rank]
    q, k, v = (torch.randn(n, h, d, device=device, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    steps = layout.steps(cp.rank, "pass-kv")
    flops = sum(ring_step_flops(s, heads, d) for s in steps)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    wall = cpu = float("inf")
    for _ in range(3):
        cp.barrier()
        sync()
        t, c = time.perf_counter(), time.process_time()
        ring_attention_pass_kv(q, k, v, cp, layout, steps=steps)
        sync()
        wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.process_time() - c)
    mine = torch.tensor([wall, cpu, flops], dtype=torch.float64)
    everyone = torch.empty(cp.size, 3, dtype=torch.float64)
    cp.all_gather(everyone, mine)
    if cp.rank == 0:
        for r, (w, c, f) in enumerate(everyone.tolist()):
            print(
                f"cp rank {r}: {tokens} tokens over cp={cp.size}, {device} {dtype}: one ring {w * 1e3:.0f} ms wall, "
                f"{c * 1e3:.0f} ms CPU, {f / 1e9:.1f} GFLOP -> {f / w / 1e12:.4f} TFLOP/s of wall, "
                f"{f / c / 1e12:.4f} TFLOP/s of CPU time"
            )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--fail-at-step", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--time", type=int, default=0, metavar="TOKENS", help="time one ring instead of checking")
    parser.add_argument("--device", default="cpu", help="with --time: cpu, or cuda (one GPU per local rank)")
    parser.add_argument("--dtype", default="float32", help="with --time: float32, bfloat16, float16")
    args = parser.parse_args()

    def body() -> int:
        world = init_world(args.backend if args.device == "cpu" else "auto", timeout=300)
        groups = build_groups(world, Mesh.build(Layout(cp=world.size), world.size))
        cp = groups.cp
        if args.time:
            device = args.device
            if device == "cuda":
                device = f"cuda:{torch.cuda.current_device()}"
            time_ring(cp, args.time, device, getattr(torch, args.dtype))
            groups.destroy()
            world.destroy()
            return 0
        if args.fail_at_step and cp.rank == 1:
            cp = FailingRing(cp, args.fail_at_step)
        rope = Rotary(HEAD_DIM, 512, 10000.0)
        lengths = [[37], [101]] if args.quick else [[37], [64], [101], [5], [37, 64]]
        cases = 0
        for seq_lens in lengths:
            for causal in (True, False):
                for dtype in (torch.float64, torch.float32):
                    cases += fresh_case(cp, seq_lens, causal, dtype, rope)
        for cached, new in [(50, 13)] if args.quick else [(50, 13), (96, 7), (3, 40)]:
            for dtype in (torch.float64, torch.float32):
                cases += cached_case(cp, cached, new, dtype)
        world.barrier()
        if world.rank == 0:
            print(f"ring-attention job ok: cp={cp.size}, {cases} ring runs checked, backend {world.backend}")
        groups.destroy()
        world.destroy()
        return 0

    return run_rank_command(body)


if __name__ == "__main__":
    sys.exit(main())
