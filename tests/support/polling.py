"""Waiting in the tests: one poll-until-deadline loop for every "wait until this holds"."""

from __future__ import annotations

import time
from typing import Callable, TypeVar, Union

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], timeout: float, what: Union[str, Callable[[], str]], interval: float = 0.05
) -> T:
    """Call `predicate` every `interval` seconds until it returns something truthy, and return that.
    After `timeout` seconds without, raise AssertionError naming `what` (a string, or a callable
    giving one at that moment, e.g. with a log tail) and the predicate's last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            described = what() if callable(what) else what
            raise AssertionError(f"{described}: not reached within {timeout} s (last value {value!r})")
        time.sleep(interval)
