"""Comparing our generations with HF transformers: shared by the exactness tests.

`assert_matches_hf` is the project's rule: greedy ids identical, logits (and the log-probs of
the chosen ids) within fp32 tolerance at every step; the only accepted difference in ids is a
near tie in HF's logits (top-2 gap < TIE_GAP), which the assertion names and after which the
comparison stops (the contexts differ from there on).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.checkpoints import hf_reference, write_hf_checkpoint

TIE_GAP = 1e-4
ATOL = RTOL = 1e-4


def prompts_for(lengths, vocab: int = 128, seed: int = 1234) -> list[list[int]]:
    """Seeded prompts of the given lengths, ids in [3, vocab) (no pad/bos/eos)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


class CheckpointStore:
    """Checkpoints and HF references built once per test module (both cost seconds)."""

    def __init__(self, root: Path, new_tokens: int):
        self.root, self.new_tokens = root, new_tokens
        self.models: dict[tuple, Path] = {}
        self.refs: dict[tuple, tuple[list[list[int]], list[torch.Tensor]]] = {}

    def model(self, arch: str, **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in self.models:
            name = arch + "".join(f"-{k}{v}" for k, v in sorted(kw.items())).replace(" ", "").replace(",", "_")
            self.models[key] = write_hf_checkpoint(self.root, arch, subdir=name, **kw)
        return self.models[key]

    def reference(self, path: Path, prompts: list[list[int]]):
        key = (str(path), tuple(map(tuple, prompts)))
        if key not in self.refs:
            self.refs[key] = hf_reference(path, prompts, self.new_tokens)
        return self.refs[key]


def steps_agreeing_with_hf(got: list[int], want: list[int], want_logits: torch.Tensor, what: str) -> int:
    """How many greedy steps to compare with HF: all of them when `got` equals HF's `want`; else up
    to the first differing step, which must be a near tie in HF's logits there (printed): after it
    the contexts differ."""
    diverge = next((i for i in range(len(want)) if got[i] != want[i]), None)
    if diverge is None:
        return len(want)
    top2 = want_logits[diverge].topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < TIE_GAP, (
        f"{what}: greedy ids differ from HF at step {diverge}: ours {list(got)} vs HF {list(want)}; "
        f"HF's top-2 logit gap there is {gap:.3g}, not a near tie (< {TIE_GAP})"
    )
    print(
        f"NOTE {what}: ids differ from HF at step {diverge} on a near tie (HF top-2 gap {gap:.3g} < {TIE_GAP}); "
        f"compared steps 0..{diverge}"
    )
    return diverge + 1


def assert_matches_hf(out: dict, dumped: list[torch.Tensor], prompts, ref_ids, ref_logits, what: str) -> None:
    """`out`: generate's JSON; `dumped`: its --dump-logits; ref_*: hf_reference's answer."""
    rows = out["outputs"]
    assert len(rows) == len(prompts) == len(dumped), what
    for b, (row, got_logits) in enumerate(zip(rows, dumped)):
        assert row["prompt_token_ids"] == prompts[b]
        ids, want_ids, want = row["token_ids"], ref_ids[b], ref_logits[b]
        new_tokens = len(want_ids)
        assert len(ids) == new_tokens, f"{what} prompt {b}: {len(ids)} tokens, want {new_tokens}"
        assert got_logits.dtype == torch.float32
        assert tuple(got_logits.shape) == tuple(want.shape), (
            f"{what} prompt {b}: logits {tuple(got_logits.shape)} vs HF {tuple(want.shape)}"
        )
        steps = steps_agreeing_with_hf(ids, want_ids, want, f"{what} prompt {b} (len {len(prompts[b])})")
        for i in range(steps):
            torch.testing.assert_close(
                got_logits[i],
                want[i],
                atol=ATOL,
                rtol=RTOL,
                msg=lambda m, i=i: f"{what} prompt {b} (len {len(prompts[b])}) step {i}: logits differ from HF\n{m}",
            )
        # our log-probabilities of our tokens, under HF's distribution (the same ids up to a near tie)
        want_lp = torch.log_softmax(want[:steps].double(), -1).gather(-1, torch.tensor(ids[:steps])[:, None])[:, 0]
        torch.testing.assert_close(
            torch.tensor(row["logprobs"][:steps], dtype=torch.float64),
            want_lp,
            atol=ATOL,
            rtol=RTOL,
            msg=lambda m: f"{what} prompt {b}: logprobs differ from HF\n{m}",
        )


def assert_outputs_match_hf(outputs, prompts, ids, logits, what: str, eos: int = 2) -> None:
    """The library's outputs (`generate(..., return_logits=True)`) against hf_reference's `ids` and
    `logits`, strictly: the library generates with EOS stop on, so a sequence may end early, at HF's
    EOS token."""
    for b, (o, want_ids, want) in enumerate(zip(outputs, ids, logits)):
        assert o.prompt_token_ids == prompts[b]
        n = len(o.token_ids)
        if o.finish_reason == "stop":  # OpenAI's name for an EOS stop
            assert o.token_ids[-1] == eos and eos not in o.token_ids[:-1]
        else:
            assert o.finish_reason == "length" and n == len(want_ids)
        assert o.token_ids == want_ids[:n], f"{what} prompt {b}: {o.token_ids} vs HF {want_ids}"
        assert eos not in want_ids[: n - 1], f"{what} prompt {b}: HF produced EOS earlier"
        torch.testing.assert_close(torch.stack(o.logits), want[:n], atol=1e-4, rtol=1e-4)


def assert_ids_match_hf(path, prompts, got: list[list[int]], n: int, what: str) -> None:
    """Ids only (a server's answers carry no logits): the first `n` of each prompt's generated ids
    equal HF's greedy ones, up to a near tie in HF's logits, which is printed."""
    from tests.support.checkpoints import load_hf_model

    model = load_hf_model(path)
    for i, (p, ids) in enumerate(zip(prompts, got)):
        (want,), (logits,) = hf_reference(None, [p], n, model=model)
        assert len(ids) >= n, f"{what} prompt {i}: {len(ids)} tokens, {n} expected"
        steps_agreeing_with_hf(ids[:n], want, logits, f"{what} prompt {i}")
