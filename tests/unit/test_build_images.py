"""hack/build-images' pure parts: reading apt sources, input hashing. No build, no cluster."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def bi():
    loader = importlib.machinery.SourceFileLoader("build_images", str(REPO / "hack" / "build-images"))
    spec = importlib.util.spec_from_loader("build_images", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_images"] = module  # dataclasses look their module up by name
    loader.exec_module(module)
    yield module
    del sys.modules["build_images"]


def test_one_line_sources(bi) -> None:
    text = """
# a comment
deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] http://mirror.example/debian/ bookworm main contrib
deb-src http://mirror.example/debian bookworm main
deb http://security.example/debian-security bookworm-security main
"""
    assert list(bi.parse_sources(text, deb822=False)) == [
        ("http://mirror.example/debian", ["bookworm"], ["main", "contrib"]),
        ("http://security.example/debian-security", ["bookworm-security"], ["main"]),
    ]


def test_deb822_sources(bi) -> None:
    text = """Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.example/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb deb-src
URIs: http://off.example/debian
Suites: bookworm
Components: main
Enabled: no

Types: deb-src
URIs: http://src.example/debian
Suites: bookworm
Components: main
"""
    assert list(bi.parse_sources(text, deb822=True)) == [
        ("http://deb.example/debian", ["bookworm", "bookworm-updates"], ["main"]),
    ]


def test_mirror_override(bi, monkeypatch) -> None:
    monkeypatch.setenv("SAVEPOINT_APT_MIRROR", "http://override.example/debian")
    assert bi.apt_mirror() == "http://override.example/debian"


def test_operator_tag_follows_its_inputs_only(bi, tmp_path: Path, monkeypatch) -> None:
    """A file under operator/ changes the operator and harness tags, not the pause tag; a
    __pycache__ file (kept out of the build context by .dockerignore) changes nothing."""
    repo = tmp_path / "repo"
    for rel in ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "operator/savepoint/__init__.py"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(rel)
    monkeypatch.setattr(bi, "REPO", repo)
    first = bi.plan()
    (repo / "operator/savepoint/__pycache__").mkdir()
    (repo / "operator/savepoint/__pycache__/x.cpython-311.pyc").write_bytes(b"junk")
    assert bi.plan() == first
    (repo / "operator/savepoint/new.py").write_text("x = 1")
    second = bi.plan()
    assert second.operator_key != first.operator_key and second.harness_key != first.harness_key
    assert (second.base_key, second.pause_key) == (first.base_key, first.pause_key)
    assert second.operator_image == f"savepoint.local/savepoint:{second.operator_key[:12]}"
