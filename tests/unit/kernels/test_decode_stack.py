"""decode_stack.py's ctypes structures against decode_stack.c's: the C side reads them by layout, so
a field added, dropped, reordered or retyped on one side only would read the wrong memory."""

from __future__ import annotations

import pytest

from dist_infer.kernels import build
from dist_infer.kernels.decode_stack import _Layer, _Linear, _Step
from tests.support.c_declarations import struct_fields

STACK_TEXT = build.SOURCES[1].read_text()
MIRRORS = {"StackLinear": _Linear, "StackLayer": _Layer, "StackStep": _Step}


def c_structs(text: str = STACK_TEXT) -> dict:
    return struct_fields(text, {"StackLinear": _Linear})


@pytest.mark.parametrize("c_name", sorted(MIRRORS))
def test_each_structure_matches_its_c_layout(c_name):
    assert c_structs()[c_name] == list(MIRRORS[c_name]._fields_)


@pytest.mark.parametrize(
    "old, new",
    [
        ("double eps, scale;", "float eps, scale;"),  # retyped
        ("long n_runs; ", "int n_runs; "),  # retyped to a narrower integer
        (
            "long table_width, window, block_size, threads;",
            "long table_width, block_size, window, threads;",
        ),  # reordered
        ("    long sgemm_row_major; ", "    long sgemm_row_major, spare; "),  # a field added in C only
    ],
)
def test_a_drifted_c_structure_is_seen(old, new):
    assert old in STACK_TEXT
    assert c_structs(STACK_TEXT.replace(old, new, 1))["StackStep"] != list(_Step._fields_)
