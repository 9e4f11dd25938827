"""Draws docs/architecture.png: dist_infer's serving processes, as boxes and arrows.

The same picture as the ASCII diagram in docs/architecture.md; change both together.

    python docs/figures/architecture_figure.py [--out docs/architecture.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

FRONT, HTTP, FLEET, WORKER = "#e8f0fe", "#c6dafc", "#d7ecd9", "#fde7c8"
INSTANCE, RANK, START = "#f3e8fd", "#ffffff", "#f1f1f1"

# (x, y, width, height, text, colour, font size): the coordinates are the figure's 20 x 12 units.
# A container's text is its title, at its top left; any other box's text is centred.
CONTAINERS = [
    (0.5, 6.2, 14.5, 4.3, "front end process: dist-infer serve  (cli/serve_frontend.py; no model rank)", FRONT, 9.5),
    (0.5, 1.6, 6.8, 3.3, "instance 0: a job of its own, tp=2", INSTANCE, 9.5),
    (8.2, 1.6, 6.8, 3.3, "instance 1: a job of its own, tp=2 x pp=2", INSTANCE, 9.5),
]
BOXES = [
    (6.0, 11.0, 8.0, 0.7, "clients: the OpenAI API over HTTP(S), streamed as server-sent events", START, 9),
    (
        0.8,
        8.5,
        10.5,
        1.3,
        "serving/http  (uvicorn + FastAPI)\n"
        "guard -> routes -> protocol -> tokenizer -> Cluster.generate\n"
        "token ids -> detokenizer -> shapers -> SSE",
        HTTP,
        8.5,
    ),
    (
        0.8,
        7.2,
        10.5,
        1.1,
        "serving/fleet: Cluster (dispatch, one record per request, a reader thread per\n"
        "instance, the control loop: serving/migration, serving/placement's autoscaler)",
        FLEET,
        8.5,
    ),
    (
        0.8,
        6.4,
        14.0,
        0.6,
        "hub (serving/fleet/hub.py): each instance's driver connects; the cluster key is checked",
        FLEET,
        8.5,
    ),
    (
        11.8,
        7.2,
        3.0,
        2.6,
        "worker processes\n(2, spawned)\n\nbig bodies parsed,\nbig prompts tokenized\n\nserving/http/\nworker_pool.py",
        WORKER,
        8,
    ),
    (0.9, 3.1, 2.6, 0.9, "rank 0: driver\nstep loop (Engine)", RANK, 8.5),
    (4.3, 3.1, 2.6, 0.9, "rank 1", RANK, 8.5),
    (
        0.9,
        1.8,
        3.8,
        0.9,
        "tp and pp groups: gloo (CPU),\nNCCL (CUDA) or MPI; small ones\nover shared memory or TCP",
        INSTANCE,
        8,
    ),
    (8.6, 3.1, 2.6, 0.9, "rank 0: driver\nstep loop (Engine)", RANK, 8.5),
    (12.0, 3.1, 2.6, 0.9, "rank 1", RANK, 8.5),
    (8.6, 1.8, 2.6, 0.9, "rank 2 (pp stage 1)", RANK, 8.5),
    (12.0, 1.8, 2.6, 0.9, "rank 3 (pp stage 1)", RANK, 8.5),
]
START_TEXT = (
    "who starts what\n(serving/placement)\n\n"
    "dist-infer serve: this is the\nfront end; it starts each\ninstance as a job of its own,\n"
    "serve --join HOST:PORT:\n  local: under our launcher\n  Ray: a placement group\n"
    "  Slurm: an srun job step\n\n"
    "torchrun, mpirun, srun or\ndist-infer launch ... serve:\nthe job's ranks are the\n"
    "instances; world rank 0 starts\nserve --frontend-only"
)
RANK_TEXT = (
    "inside every rank\n\n"
    "engine    step loop, scheduler,\n          KV cache, sampling\n"
    "models    Llama and MoE stages\n"
    "parallel  tp/ep/cp layers\n"
    "comm      gloo, NCCL, MPI;\n          the peer link\n"
    "topology  ranks, groups\n"
    "kernels   C (CPU), Triton (GPU)"
)

# (from (x, y), to (x, y), label, style): "<->" both ways, "->" one way; dashed: the peer link
ARROWS = [
    ((10.0, 11.0), (10.0, 10.5), "", "->", "solid"),
    ((11.3, 9.15), (11.8, 9.15), "", "<->", "solid"),
    ((2.2, 4.0), (2.2, 6.4), "wire messages\n(serving/fleet/wire.py)", "<->", "solid"),
    ((9.9, 4.0), (9.9, 6.4), "", "<->", "solid"),
    ((3.5, 3.55), (4.3, 3.55), "tp", "<->", "solid"),
    ((11.2, 3.55), (12.0, 3.55), "tp", "<->", "solid"),
    ((11.2, 2.25), (12.0, 2.25), "tp", "<->", "solid"),
    ((9.9, 3.1), (9.9, 2.7), "pp", "->", "solid"),
    ((13.3, 3.1), (13.3, 2.7), "pp", "->", "solid"),
    ((5.6, 3.1), (9.9, 1.8), "", "<->", "dashed"),
]
PEER_LABEL = (7.75, 1.15, "peer link (comm/peer): KV blocks of a live migration, rank to rank")


def box(ax, x: float, y: float, w: float, h: float, colour: str) -> None:
    ax.add_patch(
        FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", fc=colour, ec="#555555", lw=1.0)
    )


def draw(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(16, 9.6))
    ax.set_xlim(0, 20)
    ax.set_ylim(0.8, 12)
    ax.axis("off")
    for x, y, w, h, title, colour, size in CONTAINERS:
        box(ax, x, y, w, h, colour)
        ax.text(x + 0.2, y + h - 0.25, title, ha="left", va="center", fontsize=size, weight="bold")
    for x, y, w, h, text, colour, size in BOXES:
        box(ax, x, y, w, h, colour)
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, family="monospace")
    for y, h, text in ((6.2, 4.3, START_TEXT), (1.6, 3.3, RANK_TEXT)):
        box(ax, 15.4, y, 4.5, h, START)
        ax.text(15.6, y + h - 0.2, text, ha="left", va="top", fontsize=8.5, family="monospace")
    for (x0, y0), (x1, y1), label, style, line in ARROWS:
        ax.annotate(
            "",
            xy=(x1, y1),
            xytext=(x0, y0),
            arrowprops=dict(
                arrowstyle=style,
                lw=1.4,
                linestyle=line,
                color="#333333",
                connectionstyle="arc3,rad=0.35" if line == "dashed" else "arc3",
            ),
        )
        if label and y0 == y1:  # horizontal: the label above the arrow
            ax.text((x0 + x1) / 2, y0 + 0.18, label, fontsize=8, ha="center", va="bottom", family="monospace")
        elif label:  # vertical: beside it
            ax.text(x0 + 0.12, (y0 + y1) / 2, label, fontsize=8, ha="left", va="center", family="monospace")
    x, y, label = PEER_LABEL
    ax.text(x, y, label, fontsize=8.5, ha="center", va="center", family="monospace")
    fig.savefig(out, dpi=110, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "architecture.png",
        help="the PNG to write (default: docs/architecture.png)",
    )
    draw(parser.parse_args().out)


if __name__ == "__main__":
    main()
