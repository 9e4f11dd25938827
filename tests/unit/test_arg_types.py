"""The command line's value types: what they take, and a clear refusal (never a traceback) for the rest."""

from __future__ import annotations

import argparse

import pytest

from dist_infer.arg_types import parse_size, port_number, positive_int, positive_seconds, positive_size, size_list


@pytest.mark.parametrize(
    "text, value",
    [("4096", 4096), ("4K", 4096), ("256KB", 256 << 10), ("1.5M", 3 << 19), ("2GiB", 2 << 30), ("1T", 1 << 40)],
)
def test_sizes(text, value):
    assert parse_size(text) == positive_size(text) == value


@pytest.mark.parametrize("text", ["inf", "1e400", "nan", "x", "-4K", "0", ""])
def test_bad_sizes_are_refused_by_name(text):
    with pytest.raises(argparse.ArgumentTypeError):
        positive_size(text)


def test_size_lists_take_positive_sizes_only():
    assert size_list("4K,1M") == [4096, 1 << 20]
    for bad in ("-4K,0", "4K,,1M", "4K,inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            size_list(bad)


def test_seconds_are_finite_and_positive():
    assert positive_seconds("30") == 30.0 and positive_seconds("0.25") == 0.25
    for bad in ("inf", "1e400", "nan", "0", "-1", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_seconds(bad)


def test_ports_and_counts():
    assert port_number("0") == 0 and port_number("65535") == 65535
    for bad in ("70000", "-1", "http", "²"):
        with pytest.raises(argparse.ArgumentTypeError):
            port_number(bad)
    for bad in ("0", "-3", "1.5", "²"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)


def test_a_block_size_of_zero_is_refused_at_the_command_line(capsys):
    from dist_infer.cli.parser import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--block-size", "0"])
    assert "--block-size" in capsys.readouterr().err
