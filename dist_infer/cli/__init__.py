"""The `dist-infer` command line (also `python -m dist_infer`): the parser (`parser`), the argument
types (`dist_infer.arg_types`, shared with the layers below), and one thin module per command
(`launch_cmd`, `comm_test_cmd`, `generate_cmd`, `bench_cmd`, `plan_cmd`, `serve_cmd` with its flags
in `serve_flags`, the front end in `serve_frontend` and its HTTP flags in `http_flags`), `cp_auto`
(--cp auto) and `main`.

The top layer: it imports bench, planner, the launcher and the layers below; nothing imports it.
This package imports none of its modules, so `import dist_infer.cli` loads nothing."""
