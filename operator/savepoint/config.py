"""Every operator setting, read once from a SAVEPOINT_* environment variable.

The comment above each field says what it does, in Markdown: hack/update-readme makes
README.md's table of settings from these fields and comments (a line `Default: TEXT`
shows TEXT as the default), and hack/verify fails when the table is stale.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from savepoint.durations import parse_duration
from savepoint.errors import SettingsError


def _env(name: str, default: str) -> str:
    return os.environ.get(f"SAVEPOINT_{name}", default)


def _bool(name: str, default: bool) -> bool:
    value = _env(name, "true" if default else "false").strip().lower()
    if value not in {"1", "true", "yes", "on", "0", "false", "no", "off", ""}:
        raise SettingsError(f"SAVEPOINT_{name}={value!r}: not a boolean (use true or false)")
    return value in {"1", "true", "yes", "on"}


def _number(name: str, default: str, kind: type[int] | type[float]) -> Any:
    value = _env(name, default)
    try:
        number = kind(value)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise SettingsError(f"SAVEPOINT_{name}={value!r}: not {what}") from None
    if number < 0:
        raise SettingsError(f"SAVEPOINT_{name}={value!r}: must not be negative")
    return number


def _int(name: str, default: str) -> int:
    return int(_number(name, default, int))


def _float(name: str, default: str) -> float:
    return float(_number(name, default, float))


def _level(name: str, default: str) -> str:
    value = _env(name, default).upper()
    if value not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
        raise SettingsError(f"SAVEPOINT_{name}={value!r}: not a log level (DEBUG, INFO, WARNING, ERROR)")
    return value


def _duration(name: str, default: str) -> timedelta:
    value = _env(name, default)
    try:
        return parse_duration(value)
    except ValueError as error:
        raise SettingsError(f"SAVEPOINT_{name}: {error}") from None


# kopf pauses every replica that sees a live peer of the same or a higher priority, so
# replicas that all had the same priority would all stand by. Drawn once per process.
_PROCESS_PRIORITY = random.SystemRandom().randint(1, 2**31 - 1)


@dataclass(frozen=True)
class Settings:
    # Comma-separated namespaces to watch; empty watches the whole cluster. Each listed
    # namespace adds a watch per kind: cluster-wide uses the least memory
    # ([operations](docs/operations.md#restart)).
    # Default: (all)
    namespaces: tuple[str, ...] = field(
        default_factory=lambda: tuple(n for n in _env("NAMESPACES", "").split(",") if n)
    )
    # Python log level of the operator.
    log_level: str = field(default_factory=lambda: _level("LOG_LEVEL", "INFO"))
    # Checkpoint lifetime when neither the Checkpoint nor its namespace sets one.
    default_checkpoint_ttl: timedelta = field(default_factory=lambda: _duration("DEFAULT_CHECKPOINT_TTL", "30d"))
    # How long an Expired or Failed Checkpoint stays listable after its expiresAt before
    # it is deleted.
    expired_grace: timedelta = field(default_factory=lambda: _duration("EXPIRED_GRACE", "7d"))
    # How long a VolumeSnapshot may take to become ready before its Checkpoint fails.
    snapshot_timeout: timedelta = field(default_factory=lambda: _duration("SNAPSHOT_TIMEOUT", "10m"))
    # How long a Checkpoint waits for its Provisioning Session to become Ready, and a Fork
    # for its Pending Checkpoint, before it gives up (Rejected/SessionNotReady,
    # Failed/CheckpointNotReady): objects applied together converge (DESIGN 2).
    wait_timeout: timedelta = field(default_factory=lambda: _duration("WAIT_TIMEOUT", "10m"))
    # How long a Checkpoint's Session, or a Fork's Checkpoint, may not exist yet before
    # that is final (SessionNotFound, CheckpointNotFound): long enough for the rest of one
    # `kubectl apply` to arrive, whatever the order of its documents.
    missing_grace: timedelta = field(default_factory=lambda: _duration("MISSING_GRACE", "10s"))
    # kopf peering name; replicas sharing it elect one active operator.
    # Default: (standalone)
    peering: str = field(default_factory=lambda: _env("PEERING", ""))
    # This replica's peering priority: the live replica with the highest is active, the
    # others stand by. Random per process by default; two replicas with the same priority
    # would both pause. Set it to prefer one replica.
    # Default: (random)
    peering_priority: int = field(default_factory=lambda: _int("PEERING_PRIORITY", str(_PROCESS_PRIORITY)))
    # Seconds a replica's peering record lasts without renewal (kopf's lifetime): a killed
    # active replica is replaced within about this long.
    peering_lifetime_seconds: int = field(default_factory=lambda: _int("PEERING_LIFETIME", "60"))
    # Port of `/metrics` (Prometheus) and `/healthz`; `0` turns it off.
    metrics_port: int = field(default_factory=lambda: _int("METRICS_PORT", "8080"))
    # Serve the validating admission webhook for Checkpoint creates.
    webhook: bool = field(default_factory=lambda: _bool("WEBHOOK", False))
    # Port of the webhook's HTTPS server (path `/validate-checkpoints`), when
    # `SAVEPOINT_WEBHOOK` is true.
    webhook_port: int = field(default_factory=lambda: _int("WEBHOOK_PORT", "9443"))
    # Run Sessions' checkpoint hooks (`checkpointPolicy.hooks`) in their sandboxes through
    # the API server's `pods/exec`. When false, a Checkpoint of a Session with hooks is
    # Rejected (`HooksDisabled`); the chart's `hooks.enabled: false` sets this and drops
    # the `pods/exec` grant ([security](docs/security.md#checkpoint-hooks)).
    hooks: bool = field(default_factory=lambda: _bool("HOOKS", True))
    # Address the webhook server listens on.
    webhook_addr: str = field(default_factory=lambda: _env("WEBHOOK_ADDR", "0.0.0.0"))
    # Folder with the webhook's `tls.crt` and `tls.key` (a `kubernetes.io/tls` Secret, mounted).
    webhook_cert_dir: str = field(default_factory=lambda: _env("WEBHOOK_CERT_DIR", "/etc/savepoint/webhook-tls"))
    # Longest wait of the expiry loop, in seconds: it wakes when the soonest checkpoint the
    # watch knows falls due, and at least this often (a full listing only at start-up and
    # take-over).
    expiry_interval_seconds: float = field(default_factory=lambda: _float("EXPIRY_INTERVAL_SECONDS", "5"))
    # Threads that expire checkpoints falling due at once (an expiry storm): every snapshot's
    # deletion first, then every Expired status write; the API rate limit, not this, should
    # pace a storm.
    expiry_workers: int = field(default_factory=lambda: _int("EXPIRY_WORKERS", "16"))
    # Interval of the safety re-reconcile of every Session, in seconds; each Session's is
    # 80-100% of it, its own share, so Sessions made together do not resync together
    # (watch events drive the rest; each resync is a pass of about 5 requests, so about
    # sessions / (0.9 x interval) passes per second at rest).
    resync_seconds: float = field(default_factory=lambda: _float("RESYNC_SECONDS", "600"))
    # Seconds after which a sandbox's heartbeat (the `<session>-heartbeat` object its harness
    # writes, [event-log.md](docs/event-log.md#heartbeat)) counts as stale: the Session gets
    # the condition `HeartbeatStale` (its phase does not change).
    heartbeat_stale_seconds: float = field(default_factory=lambda: _float("HEARTBEAT_STALE_SECONDS", "60"))
    # Least seconds between two writes of one Session's `status.resources` from its
    # heartbeat: samples in between are not written (the newest is, at the next write).
    resources_interval_seconds: float = field(default_factory=lambda: _float("RESOURCES_INTERVAL_SECONDS", "30"))
    # Client-side rate limit of the operator's own API requests per second, as client-go's
    # QPS (`0` turns it off). kopf's own requests (its watch streams) are not counted.
    api_qps: float = field(default_factory=lambda: _float("API_QPS", "100"))
    # Burst allowed above that rate (client-go's Burst).
    api_burst: int = field(default_factory=lambda: _int("API_BURST", "200"))
    # Timeout of each of the operator's own API requests, in seconds, so a hung
    # connection cannot hold a worker thread (a call may pass its own).
    api_timeout_seconds: float = field(default_factory=lambda: _float("API_TIMEOUT_SECONDS", "30"))


def load() -> Settings:
    """The settings from the environment, read once at start (`python -m savepoint`) and
    passed down; a bad value raises SettingsError naming the variable and the reason."""
    return Settings()
