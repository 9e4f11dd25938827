"""Which layouts the engine can run for a model, and sweeps over them. The layout type and its
parser are the library's one (dist_infer.topology.layout), re-exported here for the planner's users."""

from __future__ import annotations

import itertools
from typing import Optional

from dist_infer.planner.shapes import ModelShape
from dist_infer.topology.layout import MODEL_AXES, Layout, LayoutError, parse_layout

__all__ = ["Layout", "LayoutError", "candidate_layouts", "parse_layout", "parse_sweep", "why_not"]


def parse_sweep(text: str) -> list[Layout]:
    """'tp=1,2 pp=1,2 cp=1,2': every combination of the listed sizes."""
    axes: dict[str, list[int]] = {}
    for part in text.split():
        axis, sep, numbers = part.partition("=")
        if not sep or axis not in MODEL_AXES:
            raise LayoutError(f'bad sweep part {part!r} in {text!r}: write e.g. "tp=1,2 pp=1,2 cp=1,2"')
        try:
            axes[axis] = sorted({int(n) for n in numbers.split(",") if n})
        except ValueError:
            raise LayoutError(f"bad sweep part {part!r} in {text!r}: sizes are integers") from None
        if not axes[axis] or min(axes[axis]) < 1:
            raise LayoutError(f"bad sweep part {part!r} in {text!r}: sizes are positive")
    names = list(axes)
    return [Layout(**dict(zip(names, combo))) for combo in itertools.product(*(axes[a] for a in names))]


def why_not(layout: Layout, shape: ModelShape, gpus: Optional[int] = None) -> Optional[str]:
    """Why the engine cannot run `layout` for this model (None: it can)."""
    if layout.dp not in (None, 1):
        return f"dp={layout.dp}: a plan is for one replica (tp x pp x cp x ep); leave dp out"
    if gpus is not None and layout.ranks != gpus:
        return f"needs {layout.ranks} ranks (tp x pp x cp x ep), not {gpus}"
    if layout.tp > shape.heads:
        return f"tp={layout.tp} is more than the {shape.heads} query heads"
    if layout.pp > shape.layers:
        return f"pp={layout.pp} is more than the {shape.layers} layers"
    if layout.cp > 1 and layout.pp > 1:
        return "cp together with pp is not supported yet"
    if layout.ep > 1:
        if not shape.experts:
            return f"ep={layout.ep} needs a mixture-of-experts model"
        if layout.ep > shape.experts:
            return f"ep={layout.ep} is more than the {shape.experts} experts"
    return None


def candidate_layouts(shape: ModelShape, gpus: int) -> list[Layout]:
    """Every layout of exactly `gpus` ranks the engine can run for this model."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    out = []
    for tp, pp, ep in itertools.product(divisors, divisors, divisors if shape.experts else [1]):
        if gpus % (tp * pp * ep) == 0:
            lay = Layout(tp, pp, gpus // (tp * pp * ep), ep)
            if why_not(lay, shape, gpus) is None:
                out.append(lay)
    return out
