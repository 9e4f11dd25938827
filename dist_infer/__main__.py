"""`python -m dist_infer` is the `dist-infer` CLI."""

from dist_infer.launch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
