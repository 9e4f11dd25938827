"""`python -m dist_infer.launch.peers`: one peer on the bench workload (see cli.py)."""

import os
import sys

from dist_infer.launch.peers.cli import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
# The results are written and the process group is gone: skip the interpreter's teardown, where
# DeepSpeed's CPU ranks now and then abort in a C++ destructor ("terminate called without an
# active exception", no Python frame left), which would turn a finished run into a failed one.
os._exit(code)
