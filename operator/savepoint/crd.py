"""Render the CustomResourceDefinitions from the pydantic models.

pydantic emits JSON Schema; Kubernetes wants a *structural* OpenAPI v3 schema: every
node typed, no `$ref`, no `anyOf` with null, no titles. `structural()` makes that
translation; `build_crds()` adds names, printer columns and the status subresource.
hack/update-crds writes the result to crds/ and the Helm chart; `hack/update-crds --check`
(run by hack/verify) fails on drift.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from savepoint import models

# JSON-Schema keywords the API server does not accept in a structural schema, or that
# only add noise to the CRD.
_DROP = {"title", "$defs", "additionalProperties_", "discriminator"}


def structural(schema: dict[str, Any], defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Inline refs, collapse Optional, and drop what a structural schema forbids."""
    defs = schema.get("$defs", {}) if defs is None else defs
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        extra = {k: v for k, v in schema.items() if k != "$ref"}
        return structural({**target, **extra}, defs)
    if "anyOf" in schema:
        branches = [b for b in schema["anyOf"] if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express anyOf with {len(branches)} non-null branches structurally")
        merged = {**branches[0], **{k: v for k, v in schema.items() if k != "anyOf"}}
        if merged.get("default", 0) is None:
            del merged["default"]
        return structural(merged, defs)
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = structural(value, defs)
        elif key == "additionalProperties":
            if isinstance(value, dict) and value:
                out[key] = structural(value, defs)
        elif key == "enum" and "type" not in schema:
            out["type"] = "string"
            out[key] = value
        else:
            out[key] = copy.deepcopy(value)  # a shared $defs list would be a YAML anchor in the CRD
    if out.get("x-kubernetes-preserve-unknown-fields"):
        out.pop("additionalProperties", None)
        out.pop("default", None)
    elif out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    return structural(model.model_json_schema(by_alias=True, mode="validation"))


@dataclass(frozen=True)
class Kind:
    kind: str
    plural: str
    short: str
    spec: type[BaseModel]
    status: type[BaseModel]
    columns: tuple[tuple[str, str, str], ...]  # (name, type, jsonPath)
    root_rules: tuple[dict[str, str], ...] = ()


KINDS = (
    Kind(
        kind="Session",
        plural="sessions",
        short="sps",
        spec=models.SessionSpec,
        status=models.SessionStatus,
        columns=(
            ("Phase", "string", ".status.phase"),
            ("Mode", "string", ".spec.operatingMode"),
            ("Events", "integer", ".status.eventLog.lastSequence"),
            ("Checkpoint", "string", ".status.latestCheckpoint"),
            ("Age", "date", ".metadata.creationTimestamp"),
        ),
        root_rules=(
            models.cel(
                f"self.metadata.name.size() <= {models.MAX_SESSION_NAME}",
                f"metadata.name must be at most {models.MAX_SESSION_NAME} characters "
                "(room for the names derived from it)",
                reason="FieldValueInvalid",
            ),
            *models.SESSION_RULES,
        ),
    ),
    Kind(
        kind="Checkpoint",
        plural="checkpoints",
        short="ckpt",
        spec=models.CheckpointSpec,
        status=models.CheckpointStatus,
        columns=(
            ("Session", "string", ".spec.sessionName"),
            ("Phase", "string", ".status.phase"),
            ("Through", "integer", ".status.throughSequence"),
            ("Label", "string", ".spec.label"),
            ("Expires", "string", ".status.expiresAt"),
            ("Reason", "string", ".status.reason"),
            ("Age", "date", ".metadata.creationTimestamp"),
        ),
    ),
    Kind(
        kind="Fork",
        plural="forks",
        short="fork",
        spec=models.ForkSpec,
        status=models.ForkStatus,
        columns=(
            ("Mode", "string", ".spec.mode"),
            ("Phase", "string", ".status.phase"),
            ("Target", "string", ".status.targetSession"),
            ("Restore", "string", ".status.restoreMode"),
            ("Reason", "string", ".status.reason"),
            ("Age", "date", ".metadata.creationTimestamp"),
        ),
    ),
)


def build_crd(kind: Kind) -> dict[str, Any]:
    root: dict[str, Any] = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": model_schema(kind.spec),
            "status": model_schema(kind.status),
        },
    }
    if kind.root_rules:
        root["x-kubernetes-validations"] = list(kind.root_rules)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{kind.plural}.{models.GROUP}"},
        "spec": {
            "group": models.GROUP,
            "names": {
                "kind": kind.kind,
                "listKind": f"{kind.kind}List",
                "plural": kind.plural,
                "singular": kind.kind.lower(),
                "shortNames": [kind.short],
                "categories": ["savepoint"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": models.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [{"name": n, "type": t, "jsonPath": p} for n, t, p in kind.columns],
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def build_crds() -> list[dict[str, Any]]:
    return [build_crd(kind) for kind in KINDS]
