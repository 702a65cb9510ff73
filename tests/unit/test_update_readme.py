"""hack/update-readme: README.md's settings table is read from config.py's own fields."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
from datetime import timedelta
from pathlib import Path

import pytest

from savepoint import config

SCRIPT = Path(__file__).resolve().parents[2] / "hack" / "update-readme"


def _load():
    loader = importlib.machinery.SourceFileLoader("update_readme", str(SCRIPT))
    spec = importlib.util.spec_from_loader("update_readme", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


update_readme = _load()


def _other_value(current: object) -> tuple[str, object]:
    """An environment value unlike the field's default, and what Settings should read from it."""
    if isinstance(current, bool):
        return ("false", False) if current else ("true", True)
    if isinstance(current, int):
        return str(current + 7), current + 7
    if isinstance(current, float):
        return str(current + 7.5), current + 7.5
    if isinstance(current, timedelta):
        return "3h", timedelta(hours=3)
    if isinstance(current, tuple):
        return "ns-a,ns-b", ("ns-a", "ns-b")
    return "some-other-value", "some-other-value"


def test_every_setting_is_a_row_and_its_variable_is_the_one_settings_reads(monkeypatch):
    rows = update_readme.settings_rows(Path(config.__file__).read_text())
    assert [r.field for r in rows] == [f.name for f in dataclasses.fields(config.Settings)]
    for row in rows:
        current = getattr(config.Settings(), row.field)
        text, expected = _other_value(current)
        if row.field == "log_level":
            text, expected = "debug", "DEBUG"
        monkeypatch.setenv(row.variable, text)
        assert getattr(config.Settings(), row.field) == expected, row
        monkeypatch.delenv(row.variable)
        assert row.meaning and row.default


def test_a_setting_without_a_comment_is_named():
    source = """
class Settings:
    # Documented.
    a: int = field(default_factory=lambda: int(_env("A", "1")))
    b: int = field(default_factory=lambda: int(_env("B", "2")))
"""
    with pytest.raises(update_readme.ConfigError, match=r"Settings\.b .*no comment"):
        update_readme.settings_rows(source)


def test_an_empty_or_computed_default_needs_a_default_line():
    source = """
class Settings:
    # Where to look.
    a: str = field(default_factory=lambda: _env("A", ""))
"""
    with pytest.raises(update_readme.ConfigError, match=r"Settings\.a .*Default:"):
        update_readme.settings_rows(source)
    shown = source.replace("    # Where to look.\n", "    # Where to look.\n    # Default: (all)\n")
    assert update_readme.settings_rows(shown) == [update_readme.Row("a", "SAVEPOINT_A", "(all)", "Where to look.")]
