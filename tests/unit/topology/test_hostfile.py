"""Hostfile parsing: both formats, comments, and errors that name the file and the line."""

from __future__ import annotations

import re

import pytest

from dist_infer.topology.hostfile import Host, HostfileError, node_rank_offsets, parse_hostfile, parse_hostfile_text
from tests.support.paths import REPO


def write(tmp_path, text, name="hosts"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_slots_form(tmp_path):
    path = write(tmp_path, "node-a slots=4\nnode-b slots=2\n")
    assert parse_hostfile(path) == [Host("node-a", 4), Host("node-b", 2)]


def test_colon_and_bare_forms(tmp_path):
    path = write(tmp_path, "gpu01:8\ngpu02\n10.0.0.3:2\n")
    assert parse_hostfile(path) == [Host("gpu01", 8), Host("gpu02", 1), Host("10.0.0.3", 2)]


def test_mixed_forms_comments_blank_lines_and_spacing(tmp_path):
    text = "# cluster\n\n   node-a   slots = 3   # trailing comment\n\t\nnode_b:2\n  # indented comment\nnode.c\n\n"
    assert parse_hostfile(write(tmp_path, text)) == [Host("node-a", 3), Host("node_b", 2), Host("node.c", 1)]


def test_order_is_rank_order(tmp_path):
    hosts = parse_hostfile(write(tmp_path, "z slots=1\na slots=1\nm slots=1\n"))
    assert [h.name for h in hosts] == ["z", "a", "m"]


def test_no_trailing_newline(tmp_path):
    assert parse_hostfile(write(tmp_path, "only:3")) == [Host("only", 3)]


def test_repo_hostfile_example_parses():
    hosts = parse_hostfile(REPO / "hostfile.example")
    assert hosts == [Host("node-a", 4), Host("node-b", 4)]


def test_parse_text_default_source():
    assert parse_hostfile_text("a slots=2") == [Host("a", 2)]
    with pytest.raises(HostfileError, match=r"^<hostfile>:1: "):
        parse_hostfile_text("a slots=0")


# -- errors: each names the file and (where there is one) the line ------------------------


def _error(tmp_path, text) -> tuple[str, str]:
    path = write(tmp_path, text)
    with pytest.raises(HostfileError) as info:
        parse_hostfile(path)
    return str(info.value), str(path)


@pytest.mark.parametrize(
    "text,line,what",
    [
        ("a slots=2\nb slots=2\na slots=1\n", 3, r"host 'a' appears twice \(first on line 1\)"),
        ("a:2\n# c\n\na\n", 4, r"host 'a' appears twice \(first on line 1\)"),
        ("a slots=2\nb slots 2\n", 2, r"malformed line 'b slots 2'"),
        ("a slots=2\nb c\n", 2, r"malformed line 'b c'"),
        ("a:\n", 1, r"malformed line 'a:'"),
        ("host name with spaces\n", 1, r"malformed line"),
        ("a slots=1\n\nb slots=0\n", 3, r"slots must be a positive integer, got '0'"),
        ("a slots=-2\n", 1, r"slots must be a positive integer, got '-2'"),
        ("a slots=two\n", 1, r"slots must be a positive integer, got 'two'"),
        ("a slots=2.5\n", 1, r"slots must be a positive integer, got '2.5'"),
        ("# first\na:0\n", 2, r"slots must be a positive integer, got '0'"),
        ("a:-1\n", 1, r"slots must be a positive integer, got '-1'"),
        ("a:x\n", 1, r"slots must be a positive integer, got 'x'"),
    ],
    ids=[
        "duplicate",
        "duplicate-mixed-forms",
        "malformed-no-equals",
        "malformed-two-words",
        "malformed-colon",
        "malformed-spaces",
        "slots-zero",
        "slots-negative",
        "slots-word",
        "slots-float",
        "colon-zero",
        "colon-negative",
        "colon-word",
    ],
)
def test_line_errors_name_file_and_line(tmp_path, text, line, what):
    message, path = _error(tmp_path, text)
    assert message.startswith(f"{path}:{line}: "), message
    assert re.search(what, message), message


@pytest.mark.parametrize(
    "text", ["", "\n\n   \n", "# nothing here\n   # still nothing\n"], ids=["empty", "blank-lines", "comments-only"]
)
def test_no_hosts_names_file(tmp_path, text):
    message, path = _error(tmp_path, text)
    assert message.startswith(f"{path}: "), message
    assert "no hosts" in message


def test_missing_file_names_it(tmp_path):
    path = tmp_path / "does-not-exist"
    with pytest.raises(HostfileError) as info:
        parse_hostfile(path)
    assert str(path) in str(info.value)
    assert "cannot read hostfile" in str(info.value)


def test_directory_is_an_error(tmp_path):
    with pytest.raises(HostfileError, match="cannot read hostfile"):
        parse_hostfile(tmp_path)


# -- offsets -------------------------------------------------------------------------------


def test_node_rank_offsets():
    assert node_rank_offsets([Host("a", 4), Host("b", 2), Host("c", 1), Host("d", 3)]) == [0, 4, 6, 7]
    assert node_rank_offsets([Host("a", 1)]) == [0]
    assert node_rank_offsets([]) == []
