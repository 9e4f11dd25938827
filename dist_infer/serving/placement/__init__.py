"""Where instances run and how many: starting each as a job of its own (locally, on Ray, under Slurm), the
bound on ranks every start is checked against, and the SLO autoscaler (its policy and its control loop)."""
