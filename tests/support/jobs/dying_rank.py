"""A job in which one rank dies mid-job: the launcher, not the survivors, must end it.

Every rank joins the world (dist_infer.comm.init_world) and all-reduces in a loop; rank
DIE_RANK (default 2) calls os._exit(DIE_CODE) (default 3) after a few iterations. A survivor
whose collective then fails does not exit: it sleeps, like a rank stuck in a hung collective,
so the job only ends quickly if the launcher stops it.

usage: python dying_rank.py [BACKEND]
"""

import os
import sys
import time

import torch

from dist_infer.comm import init_world

backend = sys.argv[1] if len(sys.argv) > 1 else "auto"
die_rank = int(os.environ.get("DIE_RANK", "2"))
die_code = int(os.environ.get("DIE_CODE", "3"))

world = init_world(backend, timeout=60)
t = torch.ones(1024)
try:
    for i in range(10_000):
        if world.rank == die_rank and i == 5:
            print(f"DIED AT {time.time()}", file=sys.stderr, flush=True)
            os._exit(die_code)
        t.fill_(1.0)
        world.all_reduce(t)
        assert float(t[0]) == world.size
except Exception as exc:  # noqa: BLE001
    print(f"rank {world.rank}: {type(exc).__name__}: {exc}; hanging", file=sys.stderr, flush=True)
time.sleep(120)
sys.exit(0)
