"""The speculative flags: a config from them, or an error naming the one that is wrong."""

from __future__ import annotations

import pytest

from dist_infer.cli.parser import build_parser


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_speculative_flags_make_a_config_or_an_error_naming_them(command, capsys):
    from dist_infer.cli.main import main
    from dist_infer.launch.speculative_flags import speculative_config, speculative_flags_error

    parser = build_parser()
    assert speculative_config(parser.parse_args([command])) is None
    args = parser.parse_args([command, "--speculative", "ngram", "--num-speculative-tokens", "6", "--ngram-min", "1"])
    assert speculative_flags_error(args) is None
    spec = speculative_config(args)
    assert (spec.method, spec.num_tokens, spec.ngram_min, spec.ngram_max, spec.adaptive) == ("ngram", 6, 1, 4, True)
    for argv, needle in [
        (["--speculative", "draft"], "--speculative draft needs --draft-model"),
        (["--draft-model", "tiny"], "--speculative draft needs --draft-model"),
        (["--speculative", "ngram", "--ngram-min", "5", "--ngram-max", "2"], "--ngram-max 2 is below --ngram-min 5"),
        (["--num-speculative-tokens", "17"], "17 is more than 16"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main([command, *argv])
        assert exit_info.value.code == 2 and needle in capsys.readouterr().err, argv
