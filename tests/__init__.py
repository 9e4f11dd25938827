"""The tests of dist_infer (tests/conftest.py says how they are laid out)."""
