"""The shared-memory collectives' buffer sizes (comm/shm.py), torch-free so the cost model can count
the segments' resident memory without loading torch."""

NBUF = 4
DEFAULT_SLOT_BYTES = 8 << 20
