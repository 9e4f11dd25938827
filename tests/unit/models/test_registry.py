"""The model registry's builders: a dense model refuses the expert options by name."""

from __future__ import annotations

import pytest
import torch

from dist_infer.models.config import ModelConfig, ModelConfigError
from dist_infer.models.registry import builder_for
from tests.support.moe_reference import MOE_CONFIG
from tests.support.threads import thread_groups


def test_dense_model_refuses_expert_options():
    cfg = ModelConfig.from_hf({**MOE_CONFIG, "model_type": "llama"})
    g = thread_groups(1, 1)[0]
    with pytest.raises(ModelConfigError, match="has no experts"):
        builder_for("llama")(cfg, g, range(0, 4), True, True, torch.float32, expert_placement="x.json")
