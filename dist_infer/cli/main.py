"""The `dist-infer` program (also `python -m dist_infer`): parse the command line, run the command."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from loguru import logger

from dist_infer.cli.bench_cmd import cmd_bench, cmd_bench_serve
from dist_infer.cli.comm_test_cmd import cmd_comm_test
from dist_infer.cli.generate_cmd import cmd_generate
from dist_infer.cli.launch_cmd import cmd_launch
from dist_infer.cli.parser import build_parser
from dist_infer.cli.plan_cmd import cmd_calibrate, cmd_plan
from dist_infer.cli.serve_cmd import cmd_serve

# every command takes (args, argv); generate, bench and serve can start their own ranks with argv
COMMANDS = {
    "launch": cmd_launch,
    "comm-test": cmd_comm_test,
    "generate": cmd_generate,
    "bench": cmd_bench,
    "serve": cmd_serve,
    "bench-serve": cmd_bench_serve,
    "plan": cmd_plan,
    "calibrate": cmd_calibrate,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logger.enable("dist_infer")  # the library is silent by default (dist_infer/__init__.py)
    parser = build_parser()
    args = parser.parse_args(argv)
    from dist_infer.cli.serve_flags import kv_mirror_flags_error
    from dist_infer.launch.speculative_flags import speculative_flags_error

    if error := speculative_flags_error(args) or kv_mirror_flags_error(args):
        parser.error(error)
    if not args.command:
        parser.print_help()
        return 2
    return COMMANDS[args.command](args, argv)


def run() -> None:
    """The program (`dist-infer`, `python -m dist_infer`): `main`, then the process ends without the
    interpreter's teardown (`exit_now`, saved in every rank of every job: docs/benchmarks.md, "What a
    local job pays to start and end")."""
    from dist_infer.topology.processes import exit_now

    exit_now(main())


if __name__ == "__main__":
    run()
