"""Rank-prefixed loguru logging: every line says which rank wrote it."""

from __future__ import annotations

import sys

from loguru import logger


def configure_logging(who: str, level: str = "INFO") -> None:
    """Send logs to stderr as `[who] HH:MM:SS LEVEL message`, `who` being e.g. 'rank 3/8'."""
    logger.enable("dist_infer")  # the library is silent until a program sets up its logging
    logger.remove()
    logger.add(
        sys.stderr,
        level=level.upper(),
        format="<green>[{extra[who]}]</green> {time:HH:mm:ss.SSS} <level>{level: <7}</level> {message}",
        colorize=None,
    )
    logger.configure(extra={"who": who})
