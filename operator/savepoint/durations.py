"""Durations as written in specs and annotations: "30d", "1h30m", "90s", "500ms"."""

from __future__ import annotations

import re
from datetime import timedelta

_UNIT = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d|w)")


def parse_duration(text: str) -> timedelta:
    """Parse a positive duration; raise ValueError naming the text otherwise."""
    text = text.strip()
    pos, seconds = 0, 0.0
    for match in _PART.finditer(text):
        if match.start() != pos:
            break
        seconds += float(match.group(1)) * _UNIT[match.group(2)]
        pos = match.end()
    if not text or pos != len(text):
        raise ValueError(f"invalid duration {text!r}: use a number with a unit, such as 30d, 12h or 90s")
    return timedelta(seconds=seconds)


def format_duration(value: timedelta) -> str:
    seconds = int(value.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
