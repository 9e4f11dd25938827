"""Fixtures shared by tests/unit's packages (helpers that are not fixtures live in tests/support)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def world_groups():
    """A gloo world of one rank for this module (torch.distributed initialises once per process):
    the single-process library path (tests/unit/engine/test_api.py and the model tests that load
    through it)."""
    import torch.distributed as dist

    from dist_infer.comm import build_groups, init_world
    from dist_infer.topology import Layout, Mesh

    if dist.is_initialized():
        pytest.skip("torch.distributed already initialised in this process by another test module")
    world = init_world("gloo")
    groups = build_groups(world, Mesh.build(Layout(), world.size))
    assert world.size == 1 and groups.tp.size == 1 and groups.pp.size == 1
    yield groups
    groups.destroy()
    world.destroy()


@pytest.fixture(autouse=True, scope="module")
def no_world_left_behind(request):
    """A module that initialises torch.distributed must tear it down: a world left behind makes
    the next module on the same pytest worker skip its single-process tests (world_groups)."""
    yield
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized()), (
        f"{request.module.__name__} left torch.distributed initialised (close what load/shard joined)"
    )
