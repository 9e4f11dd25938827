"""The routing file: measured tokens per expert and a balanced placement, saved as JSON by
`dist-infer bench --save-routing` and read back for `--expert-placement`.

File I/O lives here so that the placement logic it uses stays pure and the format (its `kind`
tag, its keys) is defined in one place, next to both its writer and its reader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence, Union

from dist_infer.parallel.moe.placement import ExpertPlacement, balanced_placement, imbalance

ROUTING_FILE_KIND = "dist-infer expert routing"


def write_routing_file(path: Union[str, Path], counts: Mapping[int, Sequence[float]], ep: int) -> dict:
    """Save measured tokens per expert (per layer) and the balanced placement for `ep`, as JSON."""
    counts = {int(layer): [float(c) for c in row] for layer, row in sorted(counts.items())}
    num_experts = len(next(iter(counts.values()))) if counts else 0
    placement = {layer: balanced_placement(row, ep) for layer, row in counts.items()}
    contiguous = ExpertPlacement.contiguous(num_experts, ep) if counts else None
    data = {
        "kind": ROUTING_FILE_KIND,
        "num_experts": num_experts,
        "ep": ep,
        "counts": {str(layer): row for layer, row in counts.items()},
        "placement": {str(layer): owner for layer, owner in placement.items()},
        "imbalance_contiguous": {
            str(layer): imbalance(contiguous.rank_loads(row)) for layer, row in counts.items() if contiguous is not None
        },  # (None: no counts, no layers)
        "imbalance_balanced": {
            str(layer): imbalance(ExpertPlacement(tuple(placement[layer]), ep).rank_loads(row))
            for layer, row in counts.items()
        },
    }
    lines = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in data.items()]  # a layer per line at most
    Path(path).write_text("{\n" + ",\n".join(lines) + "\n}\n")
    return data


def read_placement_file(path: Union[str, Path], num_experts: int, ep: int) -> dict[int, ExpertPlacement]:
    """Per-layer placements from a routing file, for a job with `ep` ranks.

    The file's own placement is used when it was computed for this ep; otherwise one is
    balanced from its measured counts (so counts measured at ep=1 serve any ep). Layers the
    file does not name keep the contiguous placement.
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read expert placement file {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"expert placement file {path} is not JSON: {exc.msg} at line {exc.lineno}") from exc
    if not isinstance(data, dict) or data.get("kind") != ROUTING_FILE_KIND:
        raise ValueError(f'{path} is not an expert routing file (no "kind": "{ROUTING_FILE_KIND}")')
    if int(data.get("num_experts", -1)) != num_experts:
        raise ValueError(f"{path} is for {data.get('num_experts')} experts per layer, the model has {num_experts}")
    out = {}
    if int(data.get("ep", 0)) == ep and data.get("placement"):
        for layer, owner in data["placement"].items():
            out[int(layer)] = ExpertPlacement(tuple(int(o) for o in owner), ep)
        return out
    if not data.get("counts"):
        raise ValueError(f"{path} has a placement for ep={data.get('ep')} and no counts to balance for ep={ep}")
    for layer, row in data["counts"].items():
        if len(row) != num_experts:
            raise ValueError(f"{path}: layer {layer} has {len(row)} counts, the model has {num_experts} experts")
        out[int(layer)] = ExpertPlacement(tuple(balanced_placement(row, ep)), ep)
    return out
