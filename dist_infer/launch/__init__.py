"""The launcher and each rank's start-up: start a job's ranks and stop them all if one dies
(`launcher`), join the job and exit so that one failing rank ends the whole job (`rank`), load this
rank's shard of the model and build its engine from the flags (`model_options`), rank-prefixed
logging (`logs`), and another `dist-infer` command run as a child job (`subcommand`).

Below the commands that start jobs (`cli`, `bench`, `planner`), above `serving` and the rest."""
