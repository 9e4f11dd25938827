"""`python -m dist_infer.bench.peers`: one peer on the bench workload (see cli.py)."""

from dist_infer.bench.peers.cli import main
from dist_infer.topology.processes import exit_now

# without the interpreter's teardown: DeepSpeed's CPU ranks now and then abort in a C++ destructor
# there ("terminate called without an active exception"), after the results are written
exit_now(main())
