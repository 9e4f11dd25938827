"""KV mirroring, driven from the front end: who mirrors to whom, the rounds, failover to the mirror."""
