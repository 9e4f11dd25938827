"""`dist-infer plan` and `dist-infer calibrate`: hand over to dist_infer.planner (no torch for plan)."""

from __future__ import annotations

import argparse
from typing import Sequence

from dist_infer.launch.logs import configure_logging


def cmd_plan(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from dist_infer.planner.plan import run_plan

    return run_plan(args)


def cmd_calibrate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from dist_infer.planner.calibrate import run_calibrate

    configure_logging("calibrate", "INFO")
    return run_calibrate(args)
