"""What running a standard checkpoint as a Ladder Residual model costs without retraining:
perplexity on a fixed text, the standard wiring against the ladder from a layer on.

The text is fixed and offline: the Zen of Python and the json module's docstring (Python 3.11).
The model is the default one (SmolLM2-135M-Instruct Q4_1), loaded dequantized by transformers from
the same GGUF file; the ladder forward is the plain torch reference the tests check our engine
against (tests/support/ladder_reference.py: greedy ids identical, logits within 1e-4 at tp=1-3 and
pp=2), so these are the engine's numbers up to that tolerance.

    python benchmarks/ladder_perplexity.py [--from-layers 15,0]
"""

from __future__ import annotations

import argparse
import codecs
import json as json_module
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from ladder_reference import reference_logits  # noqa: E402


def fixed_text() -> str:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # its import prints the Zen; its rot13 source is the text
    return codecs.decode(this.s, "rot13") + "\n\n" + (json_module.__doc__ or "")


@torch.no_grad()
def perplexity(hf, ids: list[int], ladder) -> float:
    logits = reference_logits(hf, ids, ladder)[:-1]
    nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:]))
    return math.exp(float(nll))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="'default' (the built-in GGUF) or an HF checkpoint directory")
    p.add_argument("--from-layers", default="15,0", help="ladder from each of these layers to the last")
    p.add_argument("--max-tokens", type=int, default=1024)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dist_infer.models.builtin import resolve_model

    path = Path(resolve_model(args.model))
    kw = {"gguf_file": path.name} if path.is_file() else {}
    where = str(path.parent if path.is_file() else path)
    tok = AutoTokenizer.from_pretrained(where, **kw)
    hf = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw).eval()
    ids = tok(fixed_text())["input_ids"][: args.max_tokens]
    last = hf.config.num_hidden_layers - 1
    rows = [("standard", None)] + [(f"ladder {f}:{last}", (int(f), last)) for f in args.from_layers.split(",")]
    base = None
    print(f"{len(ids)} tokens of fixed text")
    for name, ladder in rows:
        ppl = perplexity(hf, ids, ladder)
        base = base or ppl
        print(f"{name:>16}: perplexity {ppl:.2f} ({ppl / base:.2f}x standard)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
