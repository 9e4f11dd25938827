"""The decode step's all-reduce alone, through each path a tp group's small CPU collectives can take
(`--shm off`: gloo's; `socket`: the group's own TCP links, comm/socket_links.py; `auto` on one
host: the shared segment, comm/shm.py), one after the other in one job, medians.

For each path and size: back-to-back all-reduces, then the same with a 576x1536 product between
them (a module's worth of compute, as in a decode step, so a rank's wake-up is not the whole
story). Run as the two ranks of a job; only 127.0.0.1 is contacted:

    dist-infer launch --nproc-per-node 2 -- python benchmarks/small_allreduce.py [--sizes 576,73728] [--iters 400]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dist_infer.comm import build_groups, init_world
from dist_infer.topology import Layout, Mesh

PATHS = ("off", "socket", "auto")


def median_us(comm, x: torch.Tensor, w, iters: int) -> float:
    took = []
    for _ in range(iters):
        start = time.perf_counter()
        if w is not None:
            torch.matmul(x[: w.shape[0]], w)
        comm.all_reduce(x)
        x.mul_(0.5)
        took.append(time.perf_counter() - start)
    took = sorted(took[iters // 8 :])  # the first ones warm up
    return took[len(took) // 2] * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sizes",
        default="576,73728",
        help="fp32 elements per all-reduce (default: a decode's hidden 576, and a 128-token prefill's)",
    )
    p.add_argument("--iters", type=int, default=400, help="all-reduces per path and size")
    args = p.parse_args()
    torch.set_num_threads(1)
    world = init_world("gloo", timeout=60)
    w = torch.randn(576, 1536)
    out = {}
    for path in PATHS:
        groups = build_groups(world, Mesh.build(Layout(tp=world.size), world.size), path)
        for n in map(int, args.sizes.split(",")):
            x = torch.randn(n)
            out[f"{path} {n * 4} B"] = {
                "alone_us": round(median_us(groups.tp, x, None, args.iters), 1),
                "with_compute_us": round(median_us(groups.tp, x, w, args.iters), 1),
            }
        groups.destroy()
    if world.rank == 0:
        for key, value in out.items():
            print(
                f"{key:>18}: alone {value['alone_us']:8.1f} us, with a 576x1536 product between "
                f"{value['with_compute_us']:8.1f} us"
            )
        print(json.dumps(out))
    world.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
