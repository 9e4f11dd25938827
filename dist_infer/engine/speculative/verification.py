"""Verifying proposed tokens with one forward of the target: what speculation may emit.

The target's forward over the last token and K proposed ones gives logits for K + 1 positions:
position j is the distribution of the token after the history and the first j proposals. A
proposal is kept while the target agrees with it; the first disagreement is replaced by a token of
the target's own, and when all K are kept the last position gives one more (the bonus). So a step
emits between 1 and K + 1 tokens, and never anything the target would not have produced:

- greedy: the target's argmax at each position, compared with the proposal; the output is plain
  greedy decoding's, token for token (the same cleaning of the logits, the same first-index ties);
- sampled: the rejection rule of Leviathan et al. and Chen et al. (2023): accept x with
  probability min(1, p(x) / q(x)), p the target's distribution after the row's temperature,
  top-k and top-p (sampling.row_probs), q the draft's; at the first rejection draw from
  norm(max(0, p - q)). Each emitted token then has the target's distribution exactly.

Draws are counter-based as in sampling.py: position j uses the generator of token index
row.index + j. With no draft distribution (a proposal from the history, q a point mass) the rule is
applied by drawing the target's own token as plain sampling would (draw_token) and accepting the
proposal when they are equal: a probability p(x) of accepting and, on a rejection, a draw from p
without x, which is the residual. Speculation then emits exactly the tokens plain sampling emits
with the same seed, alone or in any batch, after a preemption or a move, as sampling.py promises.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch

from dist_infer.engine.sampling import RowSampling, draw_token, is_greedy, row_probs, token_generator, usable_logits


def accepted_prefix(proposed: Sequence[int], targets: Sequence[int]) -> int:
    """How many proposals the target keeps: the run of `proposed` equal to the target's own tokens
    at their positions (`targets`, one per position, K + 1 of them: each drawn as plain decoding
    would draw it there). The step emits targets[: accepted + 1]; for proposals with no draft
    distribution this is the rule below (verify_greedy, verify_sampled with draft_probs None)."""
    accepted = 0
    for token, target in zip(proposed, targets):
        if int(token) != int(target):
            break
        accepted += 1
    return accepted


def _check_inputs(target_logits: torch.Tensor, proposed: Sequence[int], draft_probs: Optional[torch.Tensor]) -> None:
    """ValueError unless the logits are [K + 1, V] for K proposals of ids in [0, V), and the draft's
    distributions, if any, are [K, V]."""
    if target_logits.dim() != 2 or target_logits.shape[0] != len(proposed) + 1:
        raise ValueError(
            f"target_logits must be [K + 1, V] for K = {len(proposed)} proposed tokens, got {list(target_logits.shape)}"
        )
    vocab = target_logits.shape[1]
    if any(not 0 <= t < vocab for t in proposed):
        raise ValueError(f"proposed token ids must be in [0, {vocab}), got {list(proposed)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (len(proposed), vocab):
        raise ValueError(f"draft_probs must be [K, V] = [{len(proposed)}, {vocab}], got {list(draft_probs.shape)}")


def verify_greedy(
    target_logits: torch.Tensor, proposed: Sequence[int], banned: Optional[torch.Tensor] = None
) -> list[int]:
    """The tokens greedy decoding emits given the target's logits [K + 1, V] over the K proposals:
    the accepted proposals, then the target's argmax at the first mismatch or, all accepted, at the
    last position. `banned` [K + 1, V] (bool): tokens each position may not take, as sample_rows
    bans EOS below a request's min_tokens (its row.ban_eos is the caller's to turn into this)."""
    _check_inputs(target_logits, proposed, None)
    proposed = [int(t) for t in proposed]
    targets = usable_logits(target_logits, banned).argmax(-1).tolist()
    for j, token in enumerate(proposed):
        if targets[j] != token:
            return [*proposed[:j], targets[j]]
    return [*proposed, targets[-1]]


def _accepts(p: torch.Tensor, q: torch.Tensor, token: int, generator: torch.Generator) -> bool:
    """Whether the draft's `token` is kept: u < p(token) / q(token) for u uniform in [0, 1)."""
    u = torch.rand(1, generator=generator, device=p.device)
    return bool(u * q[token] < p[token])


def _residual_token(p: torch.Tensor, q: torch.Tensor, generator: torch.Generator) -> int:
    """A token from norm(max(0, p - q)), the target's mass the draft did not cover; from p where
    rounding leaves the residual empty (p and q equal up to float error)."""
    residual = (p - q).clamp(min=0)
    if not residual.sum() > 0:
        residual = p
    token = int(torch.multinomial(residual, 1, generator=generator)[0])
    return token if residual[token] > 0 else int(residual.argmax())  # a uniform draw of exactly 0


def verify_sampled(
    target_logits: torch.Tensor,
    proposed: Sequence[int],
    draft_probs: Optional[torch.Tensor],
    row: RowSampling,
    banned: Optional[torch.Tensor] = None,
) -> list[int]:
    """The tokens sampling `row` emits given the target's logits [K + 1, V] over the K proposals:
    the accepted proposals, then a token from the residual at the first rejection or, all accepted,
    a token from the target at the last position (the module's docstring has the rule).

    `draft_probs` [K, V]: the distribution each proposal was drawn from (each row sums to 1); None
    for a point mass on the proposal (n-gram proposals). `row` is the request's sampling at the
    first position (row.index: tokens generated before it); a greedy row verifies greedily.
    `banned` as in verify_greedy."""
    _check_inputs(target_logits, proposed, draft_probs)
    if is_greedy(row.temperature):
        return verify_greedy(target_logits, proposed, banned)
    proposed = [int(t) for t in proposed]
    logits = usable_logits(target_logits, banned)
    out: list[int] = []
    for j, token in enumerate(proposed):
        at = replace(row, index=row.index + j)
        if draft_probs is None:
            drawn = int(draw_token(logits[j], at))
            if drawn != token:
                return out + [drawn]
        else:
            p = row_probs(logits[j], at)
            q = draft_probs[j].to(device=p.device, dtype=p.dtype)
            generator = token_generator(at.seed, at.index, p.device)
            if not _accepts(p, q, token, generator):
                return out + [_residual_token(p, q, generator)]
        out.append(token)
    return out + [int(draw_token(logits[-1], replace(row, index=row.index + len(proposed))))]
