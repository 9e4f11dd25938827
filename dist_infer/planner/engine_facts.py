"""Numbers the cost model takes from the engine, written here so the planner loads no torch (the
modules that own them import it). tests/unit/planner/test_engine_facts.py asserts each equals the
engine's own."""

MLP_ROW_CHUNK = 8192  # models/llama.py LlamaMLP.ROW_CHUNK: rows per MLP slice on a long prefill
OVERLAP_THRESHOLDS = {"cpu": None, "cuda": 1024}  # engine/engine_config.py: --overlap auto's tokens per step
