"""Whole objects as the client returns them: metadata plus the typed spec and status of savepoint.models."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from savepoint.models import (
    API_VERSION,
    CheckpointSpec,
    CheckpointStatus,
    ForkSpec,
    ForkStatus,
    Model,
    SessionSpec,
    SessionStatus,
)


class ObjectMeta(Model):
    name: str = ""
    namespace: str | None = None
    uid: str | None = None
    resource_version: str | None = None
    generation: int | None = None
    creation_timestamp: str | None = None
    deletion_timestamp: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class Object(Model):
    plural: ClassVar[str]
    api_version: str = API_VERSION
    kind: str
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)

    @property
    def name(self) -> str:
        return self.metadata.name


class Session(Object):
    plural: ClassVar[str] = "sessions"
    kind: str = "Session"
    spec: SessionSpec = Field(default_factory=SessionSpec)
    status: SessionStatus = Field(default_factory=SessionStatus)


class Checkpoint(Object):
    plural: ClassVar[str] = "checkpoints"
    kind: str = "Checkpoint"
    spec: CheckpointSpec
    status: CheckpointStatus = Field(default_factory=CheckpointStatus)


class Fork(Object):
    plural: ClassVar[str] = "forks"
    kind: str = "Fork"
    spec: ForkSpec
    status: ForkStatus = Field(default_factory=ForkStatus)


KINDS: dict[str, type[Object]] = {"Session": Session, "Checkpoint": Checkpoint, "Fork": Fork}


def typed(obj: dict[str, Any], kind: str | None = None) -> Any:
    """The typed object for a wire object of one of the three kinds."""
    return KINDS[kind or obj["kind"]].model_validate(obj)
