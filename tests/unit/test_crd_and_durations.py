"""Schema generation and duration parsing: no cluster."""

from __future__ import annotations

from datetime import timedelta

import pytest

from savepoint.crd import build_crds, structural
from savepoint.durations import format_duration, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"), [("30d", 2592000), ("1h30m", 5400), ("90s", 90), ("500ms", 0.5), ("1w", 604800)]
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "-1h", "10", "1x", "h1"])
def test_parse_duration_refuses(text):
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


def test_format_duration():
    assert format_duration(timedelta(days=30)) == "30d"
    assert format_duration(timedelta(seconds=90)) == "90s"


def _walk(node):
    yield node
    for value in node.values():
        if isinstance(value, dict):
            yield from _walk(value)


def test_schemas_are_structural():
    for crd in build_crds():
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for node in _walk(schema["properties"]["spec"]):
            assert "$ref" not in node and "anyOf" not in node and "title" not in node
        assert crd["spec"]["versions"][0]["subresources"] == {"status": {}}
        assert crd["spec"]["names"]["shortNames"]


def test_optional_collapses_and_refs_inline():
    schema = {
        "$defs": {"X": {"type": "object", "properties": {"a": {"type": "string", "title": "A"}}}},
        "type": "object",
        "properties": {"x": {"anyOf": [{"$ref": "#/$defs/X"}, {"type": "null"}], "default": None}},
    }
    assert structural(schema) == {
        "type": "object",
        "properties": {"x": {"type": "object", "properties": {"a": {"type": "string"}}}},
    }
