"""The model options every command takes: --quantization beside --dtype."""

from __future__ import annotations

import pytest

from dist_infer.cli.parser import build_parser


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_quantization_flag_beside_dtype(command):

    parser = build_parser()
    assert parser.parse_args([command]).quantization == "auto"
    assert parser.parse_args([command, "--quantization", "int4"]).quantization == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--quantization", "fp8"])
