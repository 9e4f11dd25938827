"""What the bench hands back besides the table: ratios to the peers, the PNG, the routing file,
and our own engine in one process as a peer."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from dist_infer.arg_types import strip_flag
from dist_infer.topology.subcommand import SubcommandError, run_json

# flags of this run a variant peer's run drops (what it reports), and what the variant switches
PEER_DROPS = (
    "--compare",
    "--plot",
    "--profile",
    "--save-routing",
    "--sweep",
    "--sweep-rounds",
    "--sweep-max-ranks",
    "--sweep-speed-check",
    "--hardware-profile",
)
PEER_SWITCHES = ("--json", "--overlap-report")
VARIANTS = {"ladder": ("--ladder-residual", ("all",)), "layered": ("--prefill-schedule", ("layered",))}


def ratio(ours: Optional[float], theirs: Optional[float]) -> Optional[float]:
    return ours / theirs if ours and theirs else None


def run_ours_single_process(args) -> dict:
    """This engine at tp=1 in one process using every core, for the 'same cores' comparison (the
    ranks against one process on the cores they share)."""
    cmd = [
        "bench",
        "--nproc",
        "1",
        "--batch",
        str(args.batch),
        "--prompt-len",
        str(args.prompt_len),
        "--gen-len",
        str(args.gen_len),
        "--repeat",
        str(args.repeat),
        "--json",
    ]
    if args.model:
        cmd += ["--model", args.model]
    try:
        out = run_json(cmd, args.peer_timeout)
    except SubcommandError as exc:
        return {"peer": "ours-1proc", "ok": False, "error": str(exc)}
    out.update(peer="ours-1proc", ok=True, tp=1)
    out.pop("compare", None)
    return out


def variant_refusal(args, peer: str) -> Optional[str]:
    """Why --compare `peer` (ladder, layered) cannot run beside this command line, or None."""
    if peer == "ladder" and getattr(args, "ladder_residual", None) not in (None, "off"):
        return "--compare ladder compares the standard wiring with the ladder: run it without --ladder-residual"
    if peer == "layered" and getattr(args, "prefill_schedule", "chunked") == "layered":
        return "--compare layered compares chunked prefill with layered: run it without --prefill-schedule layered"
    if peer == "layered" and getattr(args, "max_batched_tokens", None) is None:
        return (
            "--compare layered needs --max-batched-tokens: prompts over it are cut, into token chunks here "
            "and into layer groups by the peer"
        )
    return None


def run_ours_variant(args, peer: str, argv: Optional[Sequence[str]] = None) -> dict:
    """This engine on the same command line (layout, model, workload) with one thing switched (VARIANTS):
    every decoder layer a Ladder Residual layer (ladder), or prompts over the token budget computed
    layer group by layer group (layered). `argv`: this run's command line after `dist-infer`
    (default: this process's, which a rank started by our launcher, torchrun or mpirun shares with
    the user's command)."""
    refusal = variant_refusal(args, peer)
    if refusal is not None:
        return {"peer": peer, "ok": False, "error": refusal}
    switch, extra = VARIANTS[peer]
    cmd = list(sys.argv[1:] if argv is None else argv)
    for flag in PEER_DROPS + (switch,):
        cmd = strip_flag(cmd, flag)
    cmd = [a for a in cmd if a not in PEER_SWITCHES] + [switch, *extra, "--json"]
    try:
        out = run_json(cmd, args.peer_timeout)
    except SubcommandError as exc:
        return {"peer": peer, "ok": False, "error": str(exc)}
    out.update(peer=peer, ok=True)
    out.pop("compare", None)
    return out


def plot(path: str, rows: list[tuple[str, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, _ in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in (
        (axes[0], "prefill_tok_s", "prefill tokens/s"),
        (axes[1], "decode_tok_s", "decode tokens/s"),
    ):
        values = [m.get(key) or 0.0 for _, m in rows]
        bars = ax.bar(names, values, color=["tab:green"] + ["tab:gray"] * (len(rows) - 1))
        ax.bar_label(bars, fmt="%.0f")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle("dist-infer bench (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_routing(path: str, moe: Optional[dict], ep: int) -> None:
    """The measured tokens per expert and a balanced placement for `ep`, for --expert-placement."""
    from dist_infer.parallel.moe.routing_file import write_routing_file

    if moe is None:
        raise SystemExit("dist-infer bench: --save-routing needs a mixture-of-experts model")
    write_routing_file(path, {i: layer["tokens_per_expert"] for i, layer in moe["layers"].items()}, ep)
    print(f"routing counts and a balanced placement for ep={ep} written to {path}")
