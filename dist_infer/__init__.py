"""dist_infer: distributed LLM inference with communication hidden behind computation.

Layers, each importing only the ones after it:
launch -> serving -> engine -> models -> parallel -> comm -> topology.
"""

__version__ = "0.1.0"
