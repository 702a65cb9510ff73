"""Every operator setting, read once from a SAVEPOINT_* environment variable.

Each field says what it does and its default; README.md lists the same table.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from datetime import timedelta

from savepoint.durations import parse_duration


def _env(name: str, default: str) -> str:
    return os.environ.get(f"SAVEPOINT_{name}", default)


def _bool(name: str, default: bool) -> bool:
    return _env(name, "true" if default else "false").strip().lower() in {"1", "true", "yes", "on"}


# kopf pauses every replica that sees a live peer of the same or a higher priority, so
# replicas that all had the same priority would all stand by. Drawn once per process:
# load() is called many times and must always answer the same.
_PROCESS_PRIORITY = random.SystemRandom().randint(1, 2**31 - 1)


@dataclass(frozen=True)
class Settings:
    # Namespaces to watch, comma-separated; empty means the whole cluster.
    namespaces: tuple[str, ...] = field(
        default_factory=lambda: tuple(n for n in _env("NAMESPACES", "").split(",") if n)
    )
    # Python log level of the operator.
    log_level: str = field(default_factory=lambda: _env("LOG_LEVEL", "INFO").upper())
    # Checkpoint lifetime when neither the Checkpoint nor the namespace sets one (DESIGN 2).
    default_checkpoint_ttl: timedelta = field(
        default_factory=lambda: parse_duration(_env("DEFAULT_CHECKPOINT_TTL", "30d"))
    )
    # How long an Expired or Failed Checkpoint stays listable after its expiresAt before
    # it is deleted.
    expired_grace: timedelta = field(default_factory=lambda: parse_duration(_env("EXPIRED_GRACE", "7d")))
    # How long a VolumeSnapshot may take to become ready before its Checkpoint fails.
    snapshot_timeout: timedelta = field(default_factory=lambda: parse_duration(_env("SNAPSHOT_TIMEOUT", "10m")))
    # How long a Checkpoint waits for its Provisioning Session to become Ready, and a Fork
    # for its Pending Checkpoint, before it gives up (Rejected/SessionNotReady,
    # Failed/CheckpointNotReady): objects applied together converge (DESIGN 2).
    wait_timeout: timedelta = field(default_factory=lambda: parse_duration(_env("WAIT_TIMEOUT", "10m")))
    # How long a Checkpoint's Session, or a Fork's Checkpoint, may not exist yet before
    # that is final (SessionNotFound, CheckpointNotFound): long enough for the rest of one
    # `kubectl apply` to arrive, whatever the order of its documents.
    missing_grace: timedelta = field(default_factory=lambda: parse_duration(_env("MISSING_GRACE", "10s")))
    # kopf peering name; replicas sharing it elect one active operator. Empty: standalone.
    peering: str = field(default_factory=lambda: _env("PEERING", ""))
    # This replica's peering priority: of the live replicas the highest one is active, the
    # others stand by. Default: random per process (distinct for practical purposes; two
    # replicas with the same priority would both pause). Set it to prefer one replica.
    peering_priority: int = field(default_factory=lambda: int(_env("PEERING_PRIORITY", str(_PROCESS_PRIORITY))))
    # Seconds a replica's peering record stays valid without a keep-alive (kopf's lifetime):
    # a killed active replica is replaced within about this long.
    peering_lifetime_seconds: int = field(default_factory=lambda: int(_env("PEERING_LIFETIME", "60")))
    # Port of the Prometheus /metrics and /healthz endpoint; 0 turns it off.
    metrics_port: int = field(default_factory=lambda: int(_env("METRICS_PORT", "8080")))
    # Serve the validating admission webhook (DESIGN 2) when true.
    webhook: bool = field(default_factory=lambda: _bool("WEBHOOK", False))
    # Port of the admission webhook's HTTPS server (when SAVEPOINT_WEBHOOK is true).
    webhook_port: int = field(default_factory=lambda: int(_env("WEBHOOK_PORT", "9443")))
    # Address the webhook server listens on.
    webhook_addr: str = field(default_factory=lambda: _env("WEBHOOK_ADDR", "0.0.0.0"))
    # Folder holding the webhook's tls.crt and tls.key (a kubernetes.io/tls Secret, mounted).
    webhook_cert_dir: str = field(default_factory=lambda: _env("WEBHOOK_CERT_DIR", "/etc/savepoint/webhook-tls"))
    # Interval of the expiry loop, in seconds: each tick expires what the watch-fed queue
    # says is due (a full listing of checkpoints only at start-up and on take-over).
    expiry_interval_seconds: float = field(default_factory=lambda: float(_env("EXPIRY_INTERVAL_SECONDS", "5")))
    # Threads that expire the checkpoints due at once (a storm), each sending its four
    # requests in turn; the client's rate limit, not this, should be what paces a storm.
    expiry_workers: int = field(default_factory=lambda: int(_env("EXPIRY_WORKERS", "16")))
    # Interval of the safety re-reconcile of every Session, in seconds.
    resync_seconds: float = field(default_factory=lambda: float(_env("RESYNC_SECONDS", "600")))
    # Client-side rate limit of the operator's own API requests (requests per second and
    # burst), as client-go's QPS/Burst; 0 turns it off. kopf's watch streams are not counted.
    api_qps: float = field(default_factory=lambda: float(_env("API_QPS", "100")))
    api_burst: int = field(default_factory=lambda: int(_env("API_BURST", "200")))
    # Timeout of each request of the operator's own client, in seconds, so a hung
    # connection cannot hold a worker thread forever (a call may pass its own).
    api_timeout_seconds: float = field(default_factory=lambda: float(_env("API_TIMEOUT_SECONDS", "30")))


def load() -> Settings:
    return Settings()
