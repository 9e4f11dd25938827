"""The backends a job can ask for and the default time any distributed wait may take.

Torch-free, so that the command line and the launcher (which only start ranks) build their flags
without importing torch."""

BACKENDS = ("auto", "nccl", "gloo", "mpi")
DEFAULT_TIMEOUT_S = 300.0
