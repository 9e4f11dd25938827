"""bench-serve's --slo: parsed, and each bad item named (a bad flag exits 2)."""

from __future__ import annotations

import pytest

from dist_infer.bench.serve.command import main
from dist_infer.bench.serve.flags import InputError, parse_slo


def test_parse_slo():
    assert parse_slo("ttft=0.5,tpot=0.05") == {"ttft": 0.5, "tpot": 0.05}
    assert parse_slo(" E2E = 10 ") == {"e2e": 10.0}


@pytest.mark.parametrize(
    "text, named",
    [
        ("ttft=abc", "ttft=abc"),
        ("ttft=0.5,foo=1", "foo=1"),
        ("tpot", "tpot"),
        ("e2e=-1", "e2e=-1"),
        ("ttft=1,ttft=2", "ttft=2"),
        ("ttft=nan", "ttft=nan"),
    ],
)
def test_parse_slo_errors_name_the_bad_item(text, named):
    with pytest.raises(InputError, match=f"'{named}'"):
        parse_slo(text)
    with pytest.raises(InputError):
        parse_slo(",")


def test_bad_slo_flag_exits_2_naming_the_item(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--slo", "ttft=0.5,itl=3"])
    assert exc.value.code == 2
    assert "itl=3" in capsys.readouterr().err
