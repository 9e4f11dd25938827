"""`python -m dist_infer` is the `dist-infer` CLI."""

from dist_infer.cli.main import run

if __name__ == "__main__":
    run()
