"""The planner is arithmetic: the numbers it copies from the engine (planner/engine_facts.py, to stay
torch-free) must equal the engine's own. (That importing it, or running `dist-infer plan`, loads no
torch is checked in fresh interpreters: tests/integration/test_planner_cli.py.)"""


def test_engine_facts_match_the_engine():
    from dist_infer.comm import shm, shm_sizes
    from dist_infer.engine.engine_config import OVERLAP_THRESHOLDS
    from dist_infer.models.llama import LlamaMLP
    from dist_infer.parallel import overlap_policy, token_split
    from dist_infer.planner import engine_facts

    assert engine_facts.MLP_ROW_CHUNK == LlamaMLP.ROW_CHUNK
    assert engine_facts.OVERLAP_THRESHOLDS == OVERLAP_THRESHOLDS
    assert (shm.NBUF, shm.DEFAULT_SLOT_BYTES) == (shm_sizes.NBUF, shm_sizes.DEFAULT_SLOT_BYTES)
    assert token_split.should_split is overlap_policy.should_split
