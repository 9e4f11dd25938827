"""The launcher and each rank's start-up: start a job's ranks and stop them all if one dies
(`launcher`), join the job and exit so that one failing rank ends the whole job (`rank`), load this
rank's shard of the model and build its engine from the flags (`model_options`), and rank-prefixed
logging (`logs`).

One layer with `cli`, the top: above `bench` and `planner`, which import none of it (the CLI hands
the bench its ranks' start as `bench.RankStart`); the process utilities it shares with them are in
`topology` (`cores`, `processes`, `subcommand`)."""
