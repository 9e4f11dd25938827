"""dist_infer: distributed LLM inference with communication hidden behind computation.

Layers, each importing only the ones after it (the two packages of a layer may import each other):
cli / launch -> bench, planner -> serving -> engine -> models -> parallel -> comm -> topology -> kernels.
`dist_infer.arg_types` (argument types, standard library only) is outside them: any layer may use it.
"""

__version__ = "0.1.0"

from loguru import logger as _logger

_logger.disable("dist_infer")  # a library stays quiet unless its user enables it; the CLI does


def __getattr__(name):
    """`dist_infer.shard` and `dist_infer.load` without importing torch at `import dist_infer`."""
    if name in ("shard", "load", "Layout"):
        if name == "Layout":
            from dist_infer.topology import Layout

            return Layout
        from dist_infer import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'dist_infer' has no attribute {name!r}")
