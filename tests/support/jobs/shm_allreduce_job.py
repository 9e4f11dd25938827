"""One rank of a job checking the small collectives' own paths against values computed locally:
the shared segment (`shm`, the default) or the group's TCP links (`socket`).

Run under `dist-infer launch --nproc-per-node N -- python shm_allreduce_job.py [shm|socket]`.
Exercises more async ops in flight than there are buffers, waits in a different order than posts, dtypes,
a tensor too big for the path (falls back to the backend), bitwise-equal results on every rank,
all-gathers and reduce-scatters among all-reduces in flight, and a cp group's merge of decode
partials through its own path.
"""

import sys

import torch

from dist_infer.comm import build_groups, init_world
from dist_infer.comm.shm import NBUF, ShmAllReduceCommunicator
from dist_infer.comm.socket_links import SocketLinksCommunicator
from dist_infer.parallel.ring.lse import merge_across_ranks, merge_many
from dist_infer.topology import Layout, Mesh

MODE = sys.argv[1] if len(sys.argv) > 1 else "shm"
KIND, FLAG, IN_FLIGHT = {
    "shm": (ShmAllReduceCommunicator, "auto", NBUF),
    "socket": (SocketLinksCommunicator, "socket", 16),
}[MODE]
world = init_world("gloo", timeout=60)
n = world.size
groups = build_groups(world, Mesh.build(Layout(tp=n), n), FLAG)
tp = groups.tp
assert isinstance(tp, KIND), f"tp group should be a {KIND.__name__}, got {tp!r}"
me = world.rank


def value(rank, numel, salt, dtype):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def expected(numel, salt, dtype):
    parts = [value(r, numel, salt, dtype) for r in range(n)]
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


# Many ops in flight: more than the path holds, waited on in reverse order.
tensors = [value(me, 97 + i, i, torch.float32) for i in range(2 * IN_FLIGHT + 1)]
handles = [tp.all_reduce(t, async_op=True) for t in tensors]
for h in reversed(handles):
    h.wait()
for i, t in enumerate(tensors):
    assert torch.equal(t, expected(97 + i, i, torch.float32)), f"async op {i} wrong"

for dtype in (torch.float64, torch.bfloat16, torch.int64):
    t = (value(me, 1000, 7, torch.float64) * 100).to(dtype)
    tp.all_reduce(t)
    want = sum((value(r, 1000, 7, torch.float64) * 100).to(dtype).double() for r in range(n))
    bf16 = dtype == torch.bfloat16  # 8 mantissa bits, rounded after each add
    assert torch.allclose(t.double(), want, rtol=2e-2 if bf16 else 1e-12, atol=2.0 if bf16 else 0.0), dtype

# the largest tensors the path takes, more of them in flight than the sockets' buffers hold (the
# links finish their oldest op first, and a rank whose send is blocked reads what its peers sent)
largest = [value(me, tp.max_bytes // 4, 30 + i, torch.float32) for i in range(12)]
handles = [tp.all_reduce(t, async_op=True) for t in largest]
for h in handles:
    h.wait()
for i, t in enumerate(largest):
    assert torch.equal(t, expected(tp.max_bytes // 4, 30 + i, torch.float32)), f"largest op {i} wrong"

big = value(me, tp.max_bytes // 4 + 1, 9, torch.float32)  # one element too many: the backend's path
tp.all_reduce(big)
assert torch.allclose(big, expected(big.numel(), 9, torch.float32), atol=1e-5)

# every rank holds bitwise the same result
probe = value(me, 513, 11, torch.float32)
tp.all_reduce(probe)
gathered = torch.empty(n, 513)
world.all_gather(gathered, probe)
assert all(torch.equal(gathered[0], gathered[r]) for r in range(n)), "ranks disagree"

# reduce-scatter (sequence parallelism): my chunk of the sum, async among all-reduces in flight
full = value(me, 6 * n, 13, torch.float32)
mine = torch.empty(6)
other = value(me, 50, 14, torch.float32)
h1 = tp.all_reduce(other, async_op=True)
h2 = tp.reduce_scatter(mine, full, async_op=True)
h2.wait()
h1.wait()
assert torch.equal(mine, expected(6 * n, 13, torch.float32)[6 * me : 6 * (me + 1)]), "reduce_scatter chunk wrong"
assert torch.equal(other, expected(50, 14, torch.float32))

# an all-gather among all-reduces in flight
ahead = value(me, 40, 17, torch.float32)
h1 = tp.all_reduce(ahead, async_op=True)
rows = torch.empty(n, 33)
h2 = tp.all_gather(rows, value(me, 33, 18, torch.float32), async_op=True)
h2.wait()
h1.wait()
assert all(torch.equal(rows[r], value(r, 33, 18, torch.float32)) for r in range(n)), "all_gather wrong"
assert torch.equal(ahead, expected(40, 17, torch.float32))

# a cp group too: a cp decode's merge of partials (all-gather of O and LSE) through it
groups.destroy()

groups = build_groups(world, Mesh.build(Layout(cp=n), n), FLAG)
assert isinstance(groups.cp, KIND), f"cp group should be a {KIND.__name__}, got {groups.cp!r}"
o = [value(r, 3 * 4 * 8, 15, torch.float32).view(3, 4, 8) for r in range(n)]
lse = [value(r, 3 * 4, 16, torch.float32).view(3, 4) for r in range(n)]
lse[0][1] = float("-inf")  # rank 0 has no key of sequence 1
merged, merged_lse = merge_across_ranks(o[me], lse[me], groups.cp)
want, want_lse = merge_many(torch.stack(o), torch.stack(lse))
assert torch.equal(merged, want) and torch.equal(merged_lse, want_lse), f"cp merge through {MODE} differs"

world.barrier()
print(f"rank {me}: {MODE} all-reduce ok", flush=True)
groups.destroy()
world.destroy()
sys.exit(0)
