"""`--cp auto`: the context-parallel size picked from the longest prompt, before any rank starts.

Run where the command starts. Outside a launcher, cp is the largest size that leaves each rank at
least `MIN_TOKENS_PER_CP_RANK` tokens of the longest prompt, within the ranks that `--nproc` (or
else the machine's cores, or GPUs) allows after tp x pp x ep; the ranks are then started with that
number. Under torchrun, mpirun or srun the ranks already exist, so cp fills the job (world /
(tp x pp x ep)) and a prompt too short for it is logged. Every rank of a job reaches the same
number: it depends only on the flags, the prompts and the job's size.
"""

from __future__ import annotations

import os
from typing import Optional

from loguru import logger

from dist_infer.launch.logs import configure_logging
from dist_infer.topology.cores import usable_cores
from dist_infer.topology.discovery import discover


def _local_slots() -> int:
    """Ranks this machine can run side by side: its GPUs, else the cores this process may use."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return usable_cores()


def resolve_cp_auto(args, argv: list[str], longest_prompt: int) -> list[str]:
    """Replace `--cp auto` by a number in `args` and in `argv` (which the local ranks are started
    with); returns the new argv. A no-op when --cp is a number."""
    if args.cp != "auto":
        return argv
    # here, not at the top: the parallel package imports torch, which a launcher that only starts
    # ranks with a given --cp does not need
    from dist_infer.parallel.ring.sizing import MIN_TOKENS_PER_CP_RANK, choose_cp_size

    other = args.tp * args.pp * args.ep
    job = discover(os.environ)
    configure_logging("launch" if job is None else f"rank {job.rank}/{job.world_size}", args.log_level)
    if job is not None:
        if job.world_size % other:
            raise SystemExit(f"--cp auto: the job's {job.world_size} ranks do not divide by tp x pp x ep = {other}")
        cp = job.world_size // other
        if cp > 1 and longest_prompt < cp * MIN_TOKENS_PER_CP_RANK:
            logger.info(
                f"--cp auto: cp={cp} fills the job's {job.world_size} ranks, though a {longest_prompt}-token "
                f"prompt is below {MIN_TOKENS_PER_CP_RANK} tokens per rank, where cp starts to pay"
            )
    else:
        slots = args.nproc or _local_slots()
        cp = choose_cp_size(longest_prompt, max(1, slots // other))
        logger.info(
            f"--cp auto: cp={cp} for a {longest_prompt}-token prompt (at least {MIN_TOKENS_PER_CP_RANK} "
            f"tokens per rank, up to {max(1, slots // other)} cp ranks)"
        )
        if args.nproc:
            args.nproc = other * cp
    args.cp = cp
    return _with_number(argv, cp, args.nproc if job is None else None)


def _with_number(argv: list[str], cp: int, nproc: Optional[int]) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--cp" and i + 1 < len(argv):
            out += ["--cp", str(cp)]
            skip = True
        elif a.startswith("--cp="):
            out.append(f"--cp={cp}")
        elif nproc and a == "--nproc" and i + 1 < len(argv):
            out += ["--nproc", str(nproc)]
            skip = True
        elif nproc and a.startswith("--nproc="):
            out.append(f"--nproc={nproc}")
        else:
            out.append(a)
    return out
