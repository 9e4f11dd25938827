"""`dist-infer serve`'s KV mirror flags (cli/serve_flags.py): the mode and the share, checked
when parsed, and mirroring without prefix caching refused naming both flags."""

from __future__ import annotations

import pytest

from dist_infer.cli.main import main
from dist_infer.cli.parser import build_parser
from dist_infer.cli.serve_flags import kv_mirror_flags_error


def test_the_mirror_flags_and_their_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.kv_mirror, args.kv_mirror_fraction) == ("off", 0.5) and kv_mirror_flags_error(args) is None
    args = build_parser().parse_args(["serve", "--kv-mirror", "buddy", "--kv-mirror-fraction", "0.25"])
    assert (args.kv_mirror, args.kv_mirror_fraction) == ("buddy", 0.25) and kv_mirror_flags_error(args) is None


@pytest.mark.parametrize("share", ["0", "1.5", "nan", "x"])
def test_a_share_outside_0_to_1_is_refused(share, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-mirror-fraction", share])
    assert "--kv-mirror-fraction" in capsys.readouterr().err


def test_mirroring_needs_prefix_caching(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--kv-mirror", "buddy", "--prefix-caching", "off"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-mirror buddy needs prefix caching" in err and "--prefix-caching off" in err
