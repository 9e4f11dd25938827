"""Structured outputs: constrain what a request generates to a JSON schema, a regex, a choice or a
grammar, token by token, with llguidance.

- spec.py: `StructuredSpec`, what a request asks for (plain data, travels in SamplingParams);
- compiler.py: the model's vocabulary for llguidance, checking and caching grammars;
- matcher.py: a request's grammar state (rebuilt from its output ids alone) and the step's masks;
- token_mask.py: the bitmask applied to the logits on the sampler rank (pure torch).

Only the spec is exported here: the sampling parameters import it, and the other modules import
those back.
"""

from dist_infer.engine.structured.spec import StructuredSpec, StructuredSpecError

__all__ = ["StructuredSpec", "StructuredSpecError"]
