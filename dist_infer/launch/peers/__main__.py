"""`python -m dist_infer.launch.peers`: one peer on the bench workload (see cli.py)."""

import sys

from dist_infer.launch.peers.cli import main

sys.exit(main())
