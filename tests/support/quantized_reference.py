"""The float model a quantized run should equal: every weight the engine quantizes (the linear
layers, the LM head, the experts; a tied embedding table, once, for both ends), quantized shard
by shard exactly as a tp rank does at load, then dequantized into a transformers model, which is
the reference the tests compare with."""

from __future__ import annotations

import torch

from dist_infer.parallel.quantized_linear import quantize_as
from dist_infer.parallel.sharding import shard_range

ROW_PARALLEL = ("o_proj.weight", "down_proj.weight", ".w2.weight")  # sharded by input columns
COLUMN_PARALLEL = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    ".w1.weight",
    ".w3.weight",
    "lm_head.weight",
)


def dequantized(w: torch.Tensor, scheme: str, tp: int, row_parallel: bool) -> torch.Tensor:
    """w [out, in] as the ranks of a tp group hold it: a row-parallel weight quantized per column
    shard, a column-parallel one per row (its rows are independent, so the split does not matter)."""
    if not row_parallel:
        return quantize_as(w, scheme).dequantize()
    pieces = []
    for r in range(tp):
        start, length = shard_range(w.shape[1], tp, r)
        pieces.append(quantize_as(w[:, start : start + length], scheme).dequantize())
    return torch.cat(pieces, dim=1)


@torch.no_grad()
def dequantize_hf_model(model, scheme: str, tp: int):
    """`model` with its quantized weights replaced by what the engine computes with (in place).
    The fused in-memory experts (transformers' gate_up_proj [E, 2I, H], down_proj [E, H, I]) too:
    gate and up rows per expert, down per expert and column shard. A tied table (transformers lists
    it once, as the embedding) is quantized by rows, like the LM head it also is."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, param in model.named_parameters():
        if tied and param is model.get_input_embeddings().weight:
            param.copy_(dequantized(param, scheme, tp, False))
            continue
        if param.dim() == 3 and name.endswith("experts.gate_up_proj"):
            param.copy_(torch.stack([dequantized(p, scheme, tp, False) for p in param]))
        elif param.dim() == 3 and name.endswith("experts.down_proj"):
            param.copy_(torch.stack([dequantized(p, scheme, tp, True) for p in param]))
        elif param.dim() == 2 and name.endswith(ROW_PARALLEL):
            param.copy_(dequantized(param, scheme, tp, True))
        elif param.dim() == 2 and name.endswith(COLUMN_PARALLEL):
            param.copy_(dequantized(param, scheme, tp, False))
    return model
