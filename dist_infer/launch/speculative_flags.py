"""Speculative decoding's flags (engine/speculative): generate, serve and bench take the same ones; their
checks together, and the SpeculativeConfig they make."""

from __future__ import annotations

import argparse

from dist_infer.arg_types import positive_int


def speculative_config(args):
    """--speculative and its numbers as an engine/speculative SpeculativeConfig; None when off."""
    from dist_infer.engine.speculative.config import SpeculativeConfig
    from dist_infer.models.builtin import resolve_model

    if getattr(args, "speculative", "off") == "off":
        return None
    return SpeculativeConfig(
        method=args.speculative,
        num_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        adaptive=args.speculative_adaptive == "on",
        draft_model=resolve_model(args.draft_model) if args.speculative == "draft" else None,
    )


def speculative_flags_error(args) -> str | None:
    """What is wrong with the speculative flags together (checked when they are parsed), or None."""
    method = getattr(args, "speculative", "off")
    if (method == "draft") != (getattr(args, "draft_model", None) is not None):
        return "--speculative draft needs --draft-model PATH (a smaller model of the same vocabulary), and only it"
    if method != "off" and args.ngram_max < args.ngram_min:
        return f"--ngram-max {args.ngram_max} is below --ngram-min {args.ngram_min}"
    return None


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    """Speculative decoding (engine/speculative): generate, serve and bench take the same flags."""
    from dist_infer.arg_types import MAX_SPECULATIVE_TOKENS, speculative_tokens

    p.add_argument(
        "--speculative",
        choices=("off", "ngram", "draft"),
        default="off",
        help="speculative decoding: ngram proposes the tokens that followed the latest earlier occurrence "
        "of the output's last few tokens in the prompt and output (prompt lookup; no draft model); draft "
        "proposes what --draft-model (a smaller model of the same vocabulary, run greedily on the "
        "instance's first rank) would say. One step checks them all against the model, keeping the ones "
        "it would have produced itself: outputs are those of plain decoding, greedy or seeded sampling "
        "alike. ngram pays where outputs repeat their input (editing, extraction, code); off under --cp > 1 "
        "and --prefill-schedule layered, and for structured-output requests (default %(default)s)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH",
        help="--speculative draft: the draft checkpoint (HF directory or GGUF file, or a built-in name); "
        "its vocabulary must be the model's",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=speculative_tokens,
        default=4,
        metavar="K",
        help=f"most tokens proposed per request per step (1..{MAX_SPECULATIVE_TOKENS}); each request's "
        "own number adapts to how many of its proposals were kept (default %(default)s)",
    )
    p.add_argument(
        "--ngram-min",
        type=positive_int,
        default=2,
        help="shortest tail of the output looked up in its history (default %(default)s)",
    )
    p.add_argument(
        "--ngram-max",
        type=positive_int,
        default=4,
        help="longest tail looked up, tried first (default %(default)s)",
    )
    p.add_argument(
        "--speculative-adaptive",
        choices=("on", "off"),
        default="on",
        help="on: a request's proposal length follows its acceptance (doubled after a round kept whole, "
        "what was kept plus one after a partial one, a pause after misses); off: always K (default %(default)s)",
    )
