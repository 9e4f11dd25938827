"""`dist-infer generate`'s structured-output flags (cli/structured_flags.py): each flag gives its spec,
a file stands in for a long schema, at most one flag, and a bad spec ends the command naming the
flag. (Generating with them through the real CLI: tests/integration/test_structured_outputs.py.)"""

from __future__ import annotations

import json

import pytest

from dist_infer.cli.parser import build_parser
from dist_infer.cli.structured_flags import structured_spec


def spec_of(*flags: str):
    return structured_spec(build_parser().parse_args(["generate", *flags]))


def test_each_flag_gives_its_spec(tmp_path):
    from dist_infer.engine.structured.spec import StructuredSpec

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert spec_of() is None
    assert spec_of("--json-schema", json.dumps(schema)) == StructuredSpec.from_kind("json_schema", schema)
    (tmp_path / "schema.json").write_text(json.dumps(schema, indent=2))
    assert spec_of("--json-schema", f"@{tmp_path / 'schema.json'}") == StructuredSpec.from_kind("json_schema", schema)
    assert spec_of("--json-object").kind == "json_object"
    assert spec_of("--regex", "[0-9]+") == StructuredSpec("regex", "[0-9]+")
    assert spec_of("--choice", "yes", "--choice", "no") == StructuredSpec.from_kind("choice", ["yes", "no"])
    assert spec_of("--grammar", 'start: "x"') == StructuredSpec("lark", 'start: "x"')
    assert spec_of("--ebnf", 'root ::= "x"') == StructuredSpec("ebnf", 'root ::= "x"')


def test_at_most_one_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--regex", "a", "--json-object"])
    assert "not allowed with" in capsys.readouterr().err


def test_a_bad_spec_or_file_ends_the_command_naming_the_flag(tmp_path):
    with pytest.raises(SystemExit, match="--json-schema: json_schema is not valid JSON"):
        spec_of("--json-schema", "{oops")
    with pytest.raises(SystemExit, match="--grammar @.*cannot read it"):
        spec_of("--grammar", f"@{tmp_path / 'missing.lark'}")
