"""A restart joins while the hub is flooded: 20 strangers on 127.0.0.1, the
same address as the driver, reconnect to the hub as fast as they can, failing the handshake each
time, while a driver with the key joins. Before, 20 silent strangers held every handshake slot
and the driver gave up after 6 tries ("could not join the API's hub ... in 6 tries"), and each
refusal wrote a warning line. tests/support/jobs/hub_flood.py runs the hub, the strangers (a
process of their own) and the join, and reports."""

from __future__ import annotations

import sys

import pytest

from tests.support.paths import JOBS
from tests.support.processes import checkout_env, last_json, run


@pytest.mark.parametrize("mode, seconds, at_least", [("mixed", 6, 500), ("silent", 15, 20)])
def test_a_driver_joins_a_flooded_hub_and_the_log_stays_short(mode, seconds, at_least):
    """`mixed`: half send a wrong key, half connect and close (thousands of connections a
    second); `silent`: each says nothing until the hub hangs up on it, so every handshake it
    starts holds a slot for the whole key-challenge deadline (the driver waits its turn: ~13 s)."""
    result = run(
        [
            sys.executable,
            JOBS / "hub_flood.py",
            "--mode",
            mode,
            "--clients",
            "20",
            "--seconds",
            seconds,
            "--join-at",
            "1",
        ],
        timeout=60,
        env=checkout_env(),
    )
    assert result.returncode == 0
    report = last_json(result.stdout)
    assert report["joined"], f"the driver could not join the flooded hub: {report['join_error']}"
    assert report["connections"] >= at_least, f"the flood did not happen: {report}"
    assert report["refused"] >= report["connections"] - 20  # each stranger's connection was refused
    assert report["log_lines"] < 50, f"{report['log_lines']} log lines for {report['connections']} refusals"
