"""The `dist-infer` command line: launching ranks and the commands each rank runs."""
