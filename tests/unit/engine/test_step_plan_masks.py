"""The step plan's grammar masks on the wire: constrained rows' bitmasks survive encode/decode bit
for bit (odd widths, negative words), and a plan without any carries nothing more than before."""

from __future__ import annotations

import torch

from dist_infer.engine.kv_transfer import TransferOp
from dist_infer.engine.sampling import RowSampling
from dist_infer.engine.step_plan import KIND_WORK, StepPlan, decode, encode, pack_masks, unpack_masks


def plan_with(mask_rows: list[int], masks) -> StepPlan:
    return StepPlan(
        kind=KIND_WORK,
        step=9,
        seq_ids=[4, 7, 8],
        num_tokens=[1, 3, 1],
        starts=[10, 0, 5],
        block_tables=[[1, 2, 3], [4], [5, 6]],
        sample=[True, True, True],
        rows=[RowSampling(0.7, 5, 0.9, 3, 10, 2, 0), RowSampling(), RowSampling(1.0, 0, 1.0, 8, 0, 0, 1)],
        input_ids=[11, 12, 13, 14, 15],
        freed=[2],
        transfers=[TransferOp(TransferOp.COMMIT, 5)],
        layered=[(1, 0, 2)],
        mask_rows=mask_rows,
        masks=masks,
    )


def test_masks_travel_bit_for_bit_with_every_other_field():
    gen = torch.Generator().manual_seed(3)
    for words in (1, 2, 5, 32):
        masks = torch.randint(-(2**31), 2**31, (2, words), generator=gen, dtype=torch.int64).to(torch.int32)
        plan = plan_with([2, 0], masks)
        got = decode(*encode(plan))
        assert got.mask_rows == [2, 0] and torch.equal(got.masks, masks) and got.masks.dtype == torch.int32
        for name in ("seq_ids", "num_tokens", "starts", "block_tables", "sample", "rows", "input_ids", "freed"):
            assert getattr(got, name) == getattr(plan, name), name
        assert got.layered == plan.layered and len(got.transfers) == 1


def test_a_plan_without_masks_carries_none():
    plan = plan_with([], None)
    ints, floats = encode(plan)
    got = decode(ints, floats)
    assert got.mask_rows == [] and got.masks is None
    masked_ints, _ = encode(plan_with([1], torch.full((1, 32), -1, dtype=torch.int32)))
    assert masked_ints.numel() == ints.numel() + 1 + 16, "one row index and 32 words as 16 int64s"


def test_pack_and_unpack_are_inverse_for_odd_widths():
    masks = torch.tensor([[1, -1, 7], [-(2**31), 0, 2**31 - 1]], dtype=torch.int32)
    packed = pack_masks(masks)
    assert packed.dtype == torch.int64 and packed.numel() == 4
    assert torch.equal(unpack_masks(packed, 2, 3), masks)
