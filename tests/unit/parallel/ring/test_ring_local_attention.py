"""The attention-with-LSE kernel of one ring step against attention by the definition, and empty
blocks refused by name."""

from __future__ import annotations

import pytest
import torch

from dist_infer.parallel.ring.errors import RingAttentionError
from dist_infer.parallel.ring.local_attention import attention_with_lse, attention_with_lse_reference
from tests.support.attention_reference import exact_attention


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_with_lse_matches_the_definition(dtype, tol, causal):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(37, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(37, 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(37, 2, 16, generator=gen, dtype=torch.float64)
    want, want_lse = exact_attention(q, k, v, range(37), range(37), causal)
    for fn in (attention_with_lse, attention_with_lse_reference):
        o, lse = fn(q.to(dtype), k.to(dtype), v.to(dtype), causal, 0.25)
        assert o.dtype == dtype and tuple(lse.shape) == (37, 4)
        torch.testing.assert_close(o.double(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)


def test_attention_with_lse_refuses_empty_blocks():
    with pytest.raises(RingAttentionError, match="0 keys"):
        attention_with_lse(torch.randn(3, 2, 8), torch.randn(0, 2, 8), torch.randn(0, 2, 8))
