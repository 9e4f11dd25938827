"""Speculative decoding: propose a few tokens cheaply, then let one forward of the target model
check them all, keeping only what the target itself would have produced.

- ngram.py: prompt-lookup proposals, the tokens that followed the latest earlier occurrence of the
  history's last n tokens (no draft model);
- verification.py: accepting proposed tokens against the target's logits, greedy or sampled, so
  that every emitted token has the target's distribution (greedy: the target's very token).

Both are pure: the engine's step decides when to speculate and feeds them.
"""
