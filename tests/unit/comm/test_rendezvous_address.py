"""Where the job's rendezvous store listens, in this process: MASTER_ADDR resolved to
the address the store binds, and a several-host job with a loopback master refused instead of
listening on every interface. (A real 2-process job's sockets: tests/integration/test_tcpstore_bind.py.)"""

from __future__ import annotations

import pytest

from dist_infer.comm.init import store_address
from dist_infer.topology import free_port


def test_store_address_resolves_names():
    assert store_address("localhost") in ("127.0.0.1", "::1")
    assert store_address("10.1.2.3") == "10.1.2.3"


def test_a_several_host_job_with_a_loopback_master_is_refused_not_bound_to_every_interface():
    """Other hosts cannot reach 127.0.0.1; listening on every interface instead would open the
    unauthenticated store to every network: a clear error naming MASTER_ADDR."""
    from dist_infer.comm.init import BackendError, rendezvous_store
    from dist_infer.topology.discovery import RankInfo

    info = RankInfo(0, 4, 0, 2, 0, "127.0.0.1", free_port(), "torchrun-like")
    with pytest.raises(BackendError, match="MASTER_ADDR '127.0.0.1'.*never listens on every interface"):
        rendezvous_store(info, timeout=5)
