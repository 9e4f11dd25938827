"""Cache-aware dispatch without processes: the front end's prefix index (events in, leading
matches out) and the `prefix` policy's choice between a held prefix and a lighter load."""

from __future__ import annotations

from dist_infer.engine.prefix_cache import extend_hashes
from dist_infer.serving.fleet.dispatch import Dispatcher, InstanceLoad
from dist_infer.serving.fleet.prefix_index import PrefixIndex, prompt_block_hashes

BS = 16


def _tokens(prefix: int, n: int, tail: int = 0) -> list[int]:
    return [1000 * prefix + (i % 997) for i in range(n)] + [7] * tail


def test_prompt_hashes_are_the_engines_and_leave_the_last_token_out():
    tokens = _tokens(1, 64)
    assert prompt_block_hashes(tokens, BS) == extend_hashes([], tokens, BS, 3), "64 tokens: 3 blocks, not 4"
    assert len(prompt_block_hashes(tokens + [5], BS)) == 4
    assert prompt_block_hashes(tokens[:16], BS) == [] and prompt_block_hashes([], BS) == []


def test_the_index_matches_leading_blocks_only_and_follows_events():
    a, b = prompt_block_hashes(_tokens(1, 100), BS), prompt_block_hashes(_tokens(2, 100), BS)
    index = PrefixIndex(capacity=100)
    index.apply(stored=a[:4], removed=())
    assert index.matched_blocks(a) == 4 and index.matched_blocks(b) == 0
    index.apply(stored=(), removed=a[1:2])
    assert index.matched_blocks(a) == 1, "an evicted middle block ends the usable run"
    index.expect(b)
    assert index.matched_blocks(b) == len(b)
    index.clear()
    assert index.matched_blocks(b) == 0 and len(index) == 0


def test_the_index_is_bounded_and_keeps_what_was_used():
    index = PrefixIndex(capacity=8)
    keep = prompt_block_hashes(_tokens(1, 80), BS)[:4]
    index.expect(keep)
    for p in range(2, 6):
        index.matched_blocks(keep)  # used between the others' arrivals: kept
        index.expect(prompt_block_hashes(_tokens(p, 40), BS))
    assert len(index) == 8
    assert index.matched_blocks(keep) == 4


def _load(index, free, cached=0, running=0, total=400):
    return InstanceLoad(index, free_blocks=free, total_blocks=total, running=running, cached_blocks=cached)


def test_a_held_prefix_wins_over_a_slightly_lighter_load():
    d = Dispatcher("prefix")
    # a 1024-token prompt (64 blocks) + 64 new tokens: 68 blocks; instance 1 holds its prefix
    loads = [_load(0, free=380, running=1), _load(1, free=330, cached=63, running=3)]
    assert d.choose(loads, blocks_needed=68, prompt_blocks=63) == 1


def test_a_held_prefix_loses_to_a_much_lighter_load():
    d = Dispatcher("prefix")
    loads = [_load(0, free=390, running=1), _load(1, free=150, cached=63, running=8)]
    assert d.choose(loads, blocks_needed=68, prompt_blocks=63) == 0
    cost0 = d.prefix_cost(loads[0], 68, 63)
    cost1 = d.prefix_cost(loads[1], 68, 63)
    assert cost0 < cost1, (cost0, cost1)


def test_without_any_held_block_prefix_is_the_load_policy():
    loads = [_load(0, free=200, running=2), _load(1, free=300, running=4), _load(2, free=250, running=1)]
    assert Dispatcher("prefix").choose(loads, 20, 10) == Dispatcher("load").choose(loads, 20, 10)


def test_prefix_dispatch_spreads_distinct_prefixes_and_groups_equal_ones():
    """A stream of 8 prefixes x 6 requests onto 2 instances, the front end expecting each dispatched
    prompt to be cached: every request after a prefix's first finds it (the ideal hit rate), and
    the prefixes split between the instances."""
    d = Dispatcher("prefix")
    indexes = [PrefixIndex(1000), PrefixIndex(1000)]
    used = [0, 0]
    hits = first = 0
    homes: dict[int, set] = {}
    for r in range(48):
        p = r % 8
        hashes = prompt_block_hashes(_tokens(p, 1024, tail=8), BS)
        loads = [
            InstanceLoad(
                i,
                free_blocks=2000 - used[i],
                total_blocks=2000,
                running=used[i] // 68,
                cached_blocks=indexes[i].matched_blocks(hashes),
            )
            for i in range(2)
        ]
        i = d.choose(loads, 68, len(hashes))
        hits += loads[i].cached_blocks == len(hashes)
        first += p not in homes
        homes.setdefault(p, set()).add(i)
        indexes[i].expect(hashes)
        used[i] += 68 - loads[i].cached_blocks
    assert hits == 48 - first == 40
    assert all(len(h) == 1 for h in homes.values()), homes
    assert {next(iter(h)) for h in homes.values()} == {0, 1}


def test_dispatch_looks_a_prompt_up_under_its_requests_salt():
    """The front end hashes as the instance does, salt included (engine/prefix_cache.py): a request
    goes where its own salt's blocks are, and another salt's copy of the same tokens counts for nothing."""
    from types import SimpleNamespace

    from dist_infer.engine.sampling import SamplingParams
    from dist_infer.serving.fleet.router import Router

    fleet = SimpleNamespace(block_size=BS)  # what prompt_hashes reads of the fleet
    router = Router(fleet, Dispatcher("prefix"))
    tokens = _tokens(1, 200)
    salted = router.prompt_hashes(tokens, SamplingParams(cache_salt="A"))
    assert list(salted) == extend_hashes([], tokens, BS, 12, "A"), "(200 - 1) // 16 blocks, salted as the engine salts"
    index = PrefixIndex(100)
    index.expect(salted)
    assert index.matched_blocks(salted) == 12
    assert index.matched_blocks(router.prompt_hashes(tokens, SamplingParams(cache_salt="B"))) == 0
    assert index.matched_blocks(router.prompt_hashes(tokens, SamplingParams())) == 0
    assert Router(fleet, Dispatcher("load")).prompt_hashes(tokens, SamplingParams(cache_salt="A")) == ()
