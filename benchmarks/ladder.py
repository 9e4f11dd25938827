"""Ladder Residual against the standard residual on the same shapes, side by side in one run.

For each shape (random fp32 weights written with transformers: the default model's shape, and a
wider one), each round runs `dist-infer bench --tp 2` with `--ladder-residual off` and `all`, in
alternating order (the machine's speed drifts over minutes), and the medians over the rounds give
the ratios; then one `--overlap-report` run of each gives the decode step with the collectives
skipped (the lower bound), so the all-reduce time left exposed (step - no-comm step) is measured
before and after. `--shm off` runs the same over gloo's TCP path (the slower link), `--shm socket`
over the group's own TCP links (comm/socket_links.py, what a group across hosts uses).

`--two-hosts` runs the same comparison with the two tp ranks on two "hosts": two network namespaces
joined by a veth pair (benchmarks/netns_hosts.py), one `dist-infer launch --hostfile HF --node-rank K`
in each, over TCP between 10.231.X.1 and 10.231.X.2: the group's own links (`--shm socket`, the
default here: what `auto` picks for a group across hosts; the namespaces share a host name, so
`auto` itself would find one node) or gloo's (`--shm off`). The plain veth has no wire and no rate
limit, the kernel passing each packet to the other namespace's stack: about loopback's speed, but
an MTU of 1500 and two TCP stacks, as between hosts. `--link-rate 10gbit` (tc's units) caps both ends with a token-bucket filter, for a
slower interconnect's bandwidth (no added latency). Needs root. The two "hosts" share this machine's
cores: each rank gets half of them, as in the one-host runs.

`--native-kernels layers` (the default here) has both wirings call the native kernels layer by layer,
as every table in docs/benchmarks.md's ladder section was measured: the standard residual's decode
step can also run each layer's halves in one call each (kernels/decode_stack.c, `on`), which the
ladder's wiring has not got.

    python benchmarks/ladder.py --rounds 3 [--shm auto|off|socket] [--native-kernels layers|on] [--out FILE.json]
    python benchmarks/ladder.py --rounds 3 --two-hosts [--shm socket|off] [--link-rate 10gbit] [--out FILE.json]

Only 127.0.0.1 (and with --two-hosts the namespaces' 10.231.* addresses) is ever contacted. Check
`uptime` before and after: figures count on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from netns_hosts import rate_bits_per_s, two_hosts

BIN = Path(sys.executable).parent
SHAPES = {  # Llama shapes: the default model's (SmolLM2-135M) and a wider one
    "default-shape": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
    ),
    "wide": dict(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4
    ),
}


def write_checkpoint(root: Path, name: str, shape: dict) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = root / name
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True, **shape)
        LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def bench(model: str, ladder: str, args, extra: tuple = ()) -> dict:
    """One `dist-infer bench --tp 2` run: two local ranks, or with --two-hosts one in each namespace."""
    cmd = [
        str(BIN / "dist-infer"),
        "bench",
        "--model",
        model,
        "--tp",
        "2",
        "--batch",
        str(args.batch),
        "--prompt-len",
        str(args.prompt_len),
        "--gen-len",
        str(args.gen_len),
        "--repeat",
        "3",
        "--ladder-residual",
        ladder,
        "--shm",
        args.shm,
        "--native-kernels",
        args.native_kernels,
        "--json",
        *extra,
    ]
    if args.hosts is not None:
        proc = args.hosts.run(cmd, timeout=1800)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"bench failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.strip()][-1])


def exposed_decode_s(model: str, ladder: str, args) -> dict:
    """The decode step as run and with the collectives skipped (--overlap-report's lower bound)."""
    report = bench(model, ladder, args, ("--overlap-report",)).get("overlap") or {}
    decode = report.get("decode", {})
    step = decode.get("t_base_s") or decode.get("t_overlap_s")
    nocomm = decode.get("t_nocomm_s")
    return {
        "step_s": step,
        "nocomm_s": nocomm,
        "exposed_s": None if step is None or nocomm is None else max(0.0, step - nocomm),
    }


def run_shape(model: str, args) -> dict:
    runs: dict = {"off": [], "all": []}
    for r in range(args.rounds):
        for ladder in ("off", "all") if r % 2 == 0 else ("all", "off"):
            runs[ladder].append(bench(model, ladder, args))
    out = {}
    for ladder, results in runs.items():
        out[ladder] = {key: statistics.median(m[key] for m in results) for key in ("decode_tok_s", "prefill_tok_s")}
        out[ladder]["decode_tok_s_all"] = [round(m["decode_tok_s"], 2) for m in results]
        if args.overlap_report:
            out[ladder].update(exposed_decode_s(model, ladder, args))
    out["mode"] = mode(args)
    out["ratios"] = {
        "decode_ladder_over_standard": out["all"]["decode_tok_s"] / out["off"]["decode_tok_s"],
        "prefill_ladder_over_standard": out["all"]["prefill_tok_s"] / out["off"]["prefill_tok_s"],
    }
    return out


LINKS = {"off": "gloo TCP", "socket": "the group's own TCP links"}


def mode(args) -> dict:
    """How the two ranks were placed and what joins them, recorded with each shape's results."""
    if args.hosts is None:
        return {
            "hosts": "one",
            "link": LINKS[args.shm] + " over loopback" if args.shm != "auto" else "shared memory where supported",
            "shm": args.shm,
        }
    return {
        "hosts": "two",
        "link": LINKS[args.shm] + " over a veth pair between two network namespaces",
        "link_rate": args.link_rate or "unlimited (plain veth)",
        "shm": args.shm,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    p.add_argument("--rounds", type=int, default=3, help="bench runs of each setting per shape (medians reported)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument(
        "--shm",
        choices=("auto", "off", "socket"),
        default=None,
        help="off: the all-reduces over gloo's TCP path; socket: over the group's own TCP links (default: "
        "auto on one host, socket with --two-hosts)",
    )
    p.add_argument(
        "--native-kernels",
        choices=("layers", "on"),
        default="layers",
        help="layers: both wirings call the native kernels layer by layer (the tables' setting); on: the "
        "standard residual's decode steps through decode_stack.c, which the ladder has not got",
    )
    p.add_argument(
        "--two-hosts",
        action="store_true",
        help="the two ranks in two network namespaces joined by a veth pair, over TCP (--shm socket "
        "or off; needs root)",
    )
    p.add_argument(
        "--link-rate",
        default=None,
        help="with --two-hosts: cap the veth at this rate (tc's units, e.g. 10gbit; default: no cap)",
    )
    p.add_argument(
        "--overlap-report",
        choices=("on", "off"),
        default="on",
        help="also measure the exposed all-reduce time of a decode step (one extra run per setting)",
    )
    p.add_argument("--checkpoints", default=None, help="where the random checkpoints go (default: a temp dir)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    args.overlap_report = args.overlap_report == "on"
    names = args.shapes.split(",")
    if unknown := [n for n in names if n not in SHAPES]:
        p.error(f"--shapes: unknown {', '.join(unknown)}; expected some of {', '.join(SHAPES)}")
    if args.link_rate and not args.two_hosts:
        p.error("--link-rate needs --two-hosts")
    if args.link_rate:
        try:
            rate_bits_per_s(args.link_rate)
        except ValueError as exc:
            p.error(str(exc))
    if args.two_hosts and args.shm == "auto":
        p.error(
            "--two-hosts: the namespaces share a host name, so auto would share memory between them; "
            "use --shm socket (what auto picks across real hosts) or off"
        )
    args.shm = args.shm or ("socket" if args.two_hosts else "auto")
    root = Path(args.checkpoints or tempfile.mkdtemp(prefix="ladder-bench-"))
    print(f"uptime before: {os.getloadavg()}", flush=True)
    results = {}
    with ExitStack() as stack:
        args.hosts = stack.enter_context(two_hosts(args.link_rate)) if args.two_hosts else None
        if args.hosts is not None:
            print(
                f"two hosts: namespaces {', '.join(args.hosts.names)} at {', '.join(args.hosts.addrs)}, "
                f"link rate {args.link_rate or 'unlimited'}",
                flush=True,
            )
        for name in names:
            results[name] = run_shape(write_checkpoint(root, name, SHAPES[name]), args)
            report(name, results[name])
    print(f"uptime after: {os.getloadavg()}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def report(name: str, r: dict) -> None:
    print(
        f"{name}: decode tok/s standard {r['off']['decode_tok_s']:.1f} ladder {r['all']['decode_tok_s']:.1f} "
        f"({r['ratios']['decode_ladder_over_standard']:.2f}x), prefill {r['off']['prefill_tok_s']:.0f} / "
        f"{r['all']['prefill_tok_s']:.0f} ({r['ratios']['prefill_ladder_over_standard']:.2f}x); exposed "
        f"all-reduce per decode step {r['off'].get('exposed_s')} -> {r['all'].get('exposed_s')} s",
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
