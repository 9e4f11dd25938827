"""The prefix cache's salt (vLLM's cache_salt; the front end's per-key salt): the same tokens under
different salts name disjoint blocks (every block, since the salt is in the first block's hash and
each later one chains from it), equal salts share them; hashes are 128 bits. The scheduler and the
engine on a real small model: a request salted B finds nothing salt A's prompt cached, a request
salted A finds all of it, and the tokens are the same either way (a salt changes what is computed
again, never what comes out)."""

from __future__ import annotations

import pytest

from dist_infer.engine.prefix_cache import HASH_BYTES, ROOT_HASH, extend_hashes, hash_block
from dist_infer.engine.request import Request
from dist_infer.engine.sampling import MAX_CACHE_SALT_CHARS, SamplingParams, SamplingParamsError
from dist_infer.engine.scheduler import Scheduler
from dist_infer.engine.scheduler_config import SchedulerConfig
from dist_infer.serving.fleet.prefix_index import prompt_block_hashes
from tests.support.checkpoints import load_hf_model, write_hf_checkpoint
from tests.support.hf_compare import prompts_for
from tests.support.threads import thread_groups

BS = 4


def test_different_salts_give_disjoint_hashes_and_equal_salts_share():
    tokens = list(range(7, 7 + 6 * BS))
    plain = extend_hashes([], tokens, BS, 6)
    a = extend_hashes([], tokens, BS, 6, "tenant-a")
    b = extend_hashes([], tokens, BS, 6, "tenant-b")
    assert extend_hashes([], tokens, BS, 6, "tenant-a") == a, "equal salts: the same blocks"
    assert not set(a) & set(b) and not set(a) & set(plain) and not set(b) & set(plain), "every block differs"
    assert a[1] == hash_block(a[0], tokens[BS : 2 * BS]), "only the first block takes the salt; the rest chain"
    assert extend_hashes(a[:2], tokens, BS, 6, "tenant-a") == a, "extending goes on from the salted chain"
    assert extend_hashes([], tokens, BS, 6, "") != plain, "an empty salt is a salt (the API refuses it anyway)"
    assert prompt_block_hashes(tokens + [1], BS, "tenant-a") == a, "the front end's dispatch hashes alike"


def test_hashes_are_128_bits():
    hashes = extend_hashes([], list(range(3, 3 + 64 * BS)), BS, 64) + [ROOT_HASH]
    assert HASH_BYTES == 16 and all(0 <= h < 2**128 for h in hashes)
    assert sum(h >= 2**64 for h in hashes) > 48, "the upper 64 bits are used (a 64-bit hash would leave them 0)"


def test_sampling_params_check_the_salt():
    assert SamplingParams(cache_salt="x" * MAX_CACHE_SALT_CHARS).cache_salt == "x" * MAX_CACHE_SALT_CHARS
    for bad in ("", "x" * (MAX_CACHE_SALT_CHARS + 1), 7, b"bytes"):
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(cache_salt=bad)
        assert err.value.field == "cache_salt"
    assert "secret" not in repr(SamplingParams(cache_salt="secret")), "a salt stays out of logged params"


def _req(name: str, tokens: list[int], salt=None) -> Request:
    return Request(name, list(tokens), SamplingParams(max_new_tokens=2, cache_salt=salt), seed=0)


def _prefill_and_finish(s: Scheduler, r: Request) -> None:
    s.add(r)
    for c in s.schedule().chunks:
        if c.sample:
            c.request.output_token_ids.append(5)
            s.on_sampled(c.request)
    s.finish(r, "stop")


def test_a_request_with_another_salt_gets_no_cached_block():
    s = Scheduler(SchedulerConfig(num_blocks=32, block_size=BS, prefix_caching=True, watermark=0.0))
    prompt = list(range(10, 10 + 4 * BS + 1))
    _prefill_and_finish(s, _req("a", prompt, "A"))
    hits = []
    for name, salt in (("b", "B"), ("none", None), ("a2", "A")):
        before = s.prefix_cache_hits
        _prefill_and_finish(s, _req(name, prompt, salt))
        hits.append(s.prefix_cache_hits - before)
    assert hits == [0, 0, 4 * BS], "other salts (none included) miss A's blocks; salt A finds all of them"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_hf_model(write_hf_checkpoint(tmp_path_factory.mktemp("salt"), "llama-gqa"))


def test_the_engine_shares_blocks_only_within_a_salt_and_the_tokens_are_the_same(llama):
    from dist_infer.engine.engine_core import Engine, EngineConfig
    from dist_infer.models.loader import stage_from_hf_model

    (groups,) = thread_groups(1, 1)
    engine = Engine(
        stage_from_hf_model(llama, groups), groups, EngineConfig(block_size=BS, num_blocks=64, prefix_caching=True)
    )
    prompt = prompts_for([5 * BS + 2], seed=11)[0]
    outputs, hits = {}, {}
    for name, salt in (("a", "A"), ("b", "B"), ("a-again", "A"), ("plain", None)):
        before = engine.stats()["prefix_cache_hits"]
        r = engine.add_request(name, prompt, SamplingParams(max_new_tokens=6, stop_at_eos=False, cache_salt=salt))
        while engine.has_unfinished():
            engine.step()
        outputs[name], hits[name] = r.output_token_ids, engine.stats()["prefix_cache_hits"] - before
    engine.stop_followers()
    assert hits == {"a": 0, "b": 0, "a-again": 5 * BS, "plain": 0}, hits
    assert len(set(map(tuple, outputs.values()))) == 1, outputs
