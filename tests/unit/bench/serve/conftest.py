"""The structured-output fixtures, for --dataset json-schema's grammar tests (tests/support/structured_fixtures.py)."""

from tests.support.structured_fixtures import small_checkpoint, text_tokenizer  # noqa: F401
