"""The cut an admission decides for a Checkpoint, as the annotation that carries it.

The operator writes it on the VolumeSnapshot's create request and on the Checkpoint
(savepoint.checkpoint); the Python client reads it to say what an admitted checkpoint
is doing before it has a phase. Standard library only, so both may import it.
"""

from __future__ import annotations

import json
from typing import Any

from savepoint.constants import CUT_ANNOTATION

# What an admission decides of a Checkpoint's status: the cut, the snapshot's name and the clock.
CUT_FIELDS = (
    "throughSequence",
    "throughEventId",
    "harnessRevision",
    "profileRevision",
    "volumeSnapshotName",
    "createdAt",
    "expiresAt",
)


def cut_annotation(status: dict[str, Any]) -> str:
    """The cut fields of a status, as the CUT_ANNOTATION value."""
    return json.dumps({k: status.get(k) for k in CUT_FIELDS}, separators=(",", ":"), sort_keys=True)


def cut_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The cut an object's CUT_ANNOTATION carries; None when it has none (or one unreadable)."""
    text = ((obj.get("metadata") or {}).get("annotations") or {}).get(CUT_ANNOTATION)
    try:
        cut = json.loads(text) if text else None
    except ValueError:
        return None
    if not isinstance(cut, dict) or not isinstance(cut.get("throughSequence"), int) or not cut.get("createdAt"):
        return None
    return {k: cut.get(k) for k in CUT_FIELDS}
