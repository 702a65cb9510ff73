"""Pure helpers to set conditions (their types and reasons are named in savepoint.constants)."""

from __future__ import annotations

from typing import Any

from savepoint.constants import ConditionType as ConditionType
from savepoint.constants import Reason as Reason
from savepoint.timestamps import now_rfc3339


def set_condition(
    conditions: list[dict[str, Any]],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    generation: int | None,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """Return conditions with one entry replaced; lastTransitionTime moves only on a status change."""
    wanted = "True" if status else "False"
    previous = next((c for c in conditions if c.get("type") == type_), None)
    moved = previous is None or previous.get("status") != wanted
    entry = {
        "type": type_,
        "status": wanted,
        "reason": reason,
        "message": message,
        "lastTransitionTime": (now or now_rfc3339()) if moved else (previous or {}).get("lastTransitionTime"),
        "observedGeneration": generation,
    }
    return [c for c in conditions if c.get("type") != type_] + [entry]
