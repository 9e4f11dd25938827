"""--overlap-report: the same workload with each group's communication overlapped, serialised or
skipped, and how much of it the schedules hide."""

from __future__ import annotations

from dist_infer.bench.timing import measure

MEASURED_GROUPS = ("tp", "pp", "cp")  # the groups whose communication --overlap-report measures


def hidden_fraction(t_base: float, t_overlap: float, t_nocomm: float) -> float:
    """Share of the exposed communication time that overlap removed: (base - overlap) / (base - nocomm)."""
    exposed = t_base - t_nocomm
    return (t_base - t_overlap) / exposed if exposed > 0 else 0.0


def report_runs(runs: dict) -> dict:
    """t_base/t_overlap/t_nocomm, the hidden fraction and the exposed time (t_overlap - t_nocomm:
    what the communication still costs), for prefill (ttft) and per decode step, plus the
    seconds each run spent waiting inside communication calls. No "base" run: t_base_s and
    hidden_fraction are None."""

    def phase(key: str) -> dict:
        t = {f"t_{n}_s": runs[n][key] if n in runs else None for n in ("base", "overlap", "nocomm")}
        hidden = None if t["t_base_s"] is None else hidden_fraction(t["t_base_s"], t["t_overlap_s"], t["t_nocomm_s"])
        extra = {"t_sequence_parallel_s": runs["sequence_parallel"][key]} if "sequence_parallel" in runs else {}
        return {**t, "hidden_fraction": hidden, "exposed_s": max(0.0, t["t_overlap_s"] - t["t_nocomm_s"]), **extra}

    return {
        **phase("ttft_s"),
        "decode": phase("tpot_s"),
        "waiting_s": {n: r.get("exposed_s", {}) for n, r in runs.items()},
    }


# The runs per group: (name in the report, token split for tp, communicator mode).
# tp: plain tensor parallel, token split, collectives skipped, and the sequence-parallel variant
# (reduce-scatter + all-gather around the norms), all with the same workload.
TP_RUNS = (
    ("base", "off", "off", "overlap"),
    ("overlap", "on", "off", "overlap"),
    ("nocomm", "off", "off", "skip"),
    ("sequence_parallel", "off", "on", "overlap"),
)
# Ring transfers are posted in send/receive pairs, so waiting for each at once is a valid
# no-overlap baseline. Pipeline sends are not: a stage blocking in send until the next stage
# receives deadlocks the microbatch schedule, so pp reports the exposed time without a base.
P2P_RUNS = {
    "cp": (("base", "serial"), ("overlap", "overlap"), ("nocomm", "skip")),
    "pp": (("overlap", "overlap"), ("nocomm", "skip")),
}


def overlap_runs(engine, groups, prompts, args, progress) -> dict:
    """The runs per measured group: how much of each kind of communication is hidden.

    tp: base = no token splitting, overlap = the token-split schedule, nocomm = collectives
    skipped, and the sequence-parallel variant alongside. cp (ring-attention transfers) and pp (pipeline stage sends), overlapped by design:
    base = every transfer waited for as soon as it is posted (cp only), overlap = the normal
    schedule, nocomm = the transfers' payloads skipped."""
    comms = {g: getattr(groups, g) for g in MEASURED_GROUPS}
    out = {}
    if groups.tp.size > 1:
        runs = {}
        for name, split, sp, mode in TP_RUNS:
            engine.overlap, engine.sequence_parallel = split, sp
            groups.tp.set_mode(mode)
            runs[name] = measure(engine, prompts, args.gen_len, args.repeat, progress, comms)
        engine.overlap, engine.sequence_parallel = args.overlap, args.sequence_parallel
        groups.tp.set_mode("overlap")
        out["tp"] = report_runs(runs)
    for g, plan in P2P_RUNS.items():
        comm = getattr(groups, g)
        if comm.size == 1:
            continue
        runs = {}
        for name, mode in plan:
            comm.set_mode(mode)
            runs[name] = measure(engine, prompts, args.gen_len, args.repeat, progress, comms)
        comm.set_mode("overlap")
        out[g] = report_runs(runs)
    return out


def overlap_report(engine, groups, prompts, args, progress) -> dict:
    """`{"overlap": ...}` of the JSON: the tp numbers at the top level (where they were before the
    pipeline's and the ring's joined), the pipeline and ring transfers under "pp" and "cp"."""
    runs = overlap_runs(engine, groups, prompts, args, progress)
    tp = runs.pop("tp", None)
    return {**(tp or {}), **runs, "tokens_per_prefill": sum(len(p) for p in prompts)}


def format_overlap(overlap: dict) -> str:
    def ms(v) -> str:
        return "-" if v is None else f"{v * 1e3:.1f} ms"

    lines = []
    sections = [
        ("tp collectives (token split)", overlap if "t_overlap_s" in overlap else None),
        ("pp stage transfers", overlap.get("pp")),
        ("cp ring transfers", overlap.get("cp")),
    ]
    for title, o in sections:
        if not o:
            continue
        for phase, label in (("prefill", "prefill (ttft)"), ("decode", "decode (per step)")):
            p = o["decode"] if phase == "decode" else o
            hidden = "" if p["hidden_fraction"] is None else f", hidden fraction {p['hidden_fraction']:.2f}"
            sp = f"; sequence parallel {ms(p['t_sequence_parallel_s'])}" if "t_sequence_parallel_s" in p else ""
            lines.append(
                f"overlap, {title}, {label}: base {ms(p['t_base_s'])}, overlapped {ms(p['t_overlap_s'])}, "
                f"no communication {ms(p['t_nocomm_s'])} -> exposed {ms(p['exposed_s'])}{hidden}{sp}"
            )
        waits = o.get("waiting_s", {}).get("overlap", {})
        waits = ", ".join(f"{g} {sum(ops.values()) * 1e3:.1f} ms" for g, ops in waits.items() if ops)
        if waits:
            lines.append(f"  time inside communication calls in the overlapped run (whole generation): {waits}")
    return "\n".join(lines)
