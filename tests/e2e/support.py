"""What the fault tests (tests/e2e/test_faults.py) and the peering test need besides the
tests: namespaces of their own, API calls that outlive an API server restart, the mixed
workload, the invariants it must leave and a wait until they hold, and restarts of the
local control plane's processes."""

from __future__ import annotations

import os
import random
import re
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import client

from savepoint.checkpoint import CHECKPOINT_LABEL, snapshot_name
from savepoint.eventlog import EventLog
from savepoint.fork import RESTORING_ANNOTATION
from savepoint.models import GROUP, VERSION
from savepoint.session import SESSION_LABEL, pod_name
from tests.conftest import REPO, SNAP, _has_default_sa, unique, wait_for
from tests.csi_data import PVCDataError, pvc_data_dir
from tests.integration.test_session import KWOK_POD
from tests.operator_process import OperatorProcess

CHECKPOINT_TERMINAL = ("Ready", "Rejected", "Failed", "Expired")
FORK_TERMINAL = ("Succeeded", "Failed")
LIVE = ("Ready", "Running", "AwaitingApproval")  # a session whose restore is done
REQUEST_TIMEOUT = 15  # seconds; a call to an API server whose etcd is down must not hang the test


def seed() -> int:
    value = int(os.environ.get("SAVEPOINT_FAULT_SEED") or random.randrange(2**31))
    print(f"\nfault seed: SAVEPOINT_FAULT_SEED={value}")
    return value


# --- namespaces of the test's own ---------------------------------------------------


def shared_operator_started(request: pytest.FixtureRequest) -> bool:
    """Whether conftest's cluster-wide `operator` fixture is already running in this session
    (it would act on a test's own namespace too)."""
    for name in ("operator_process", "operator"):
        try:
            defs = request._fixturemanager.getfixturedefs(name, request.node)
        except (AttributeError, TypeError):
            continue
        if any(d.scope == "session" and getattr(d, "cached_result", None) is not None for d in defs or ()):
            return True
    return False


def make_namespace(core, prefix: str) -> str:
    """A fresh test namespace named after `prefix`, with its default ServiceAccount in place."""
    namespace = unique(prefix)
    core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace, labels={"savepoint.dev/test": "true"}))
    )
    wait_for(lambda: _has_default_sa(core, namespace), timeout=60, what=f"default ServiceAccount in {namespace}")
    return namespace


def delete_namespace(core, namespace: str) -> None:
    """Delete a namespace and wait until it is gone (Checkpoint finalizers need an operator)."""
    core.delete_namespace(namespace, propagation_policy="Background")
    wait_for(lambda: _gone(core, namespace), timeout=180, interval=1, what=f"namespace {namespace} deleted")


def _gone(core, namespace: str) -> bool:
    try:
        core.read_namespace(namespace)
        return False
    except client.ApiException as err:
        return err.status == 404


# --- API calls that outlive an API server restart -----------------------------------


def retrying(call: Callable[[], Any], timeout: float = 120, exists_ok: bool = False) -> Any:
    """call(), retried while the API server or etcd is away; 409 on a create is success with exists_ok."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except client.ApiException as err:
            if err.status == 409 and exists_ok:
                return None  # an earlier attempt landed but its answer was lost
            if err.status not in (0, 429, 500, 502, 503, 504):
                raise
        except (urllib3.exceptions.HTTPError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the API server did not answer within {timeout}s")
        time.sleep(0.5)


def create(crds, namespace: str, plural: str, body: dict) -> None:
    retrying(
        lambda: crds.create_namespaced_custom_object(
            GROUP, VERSION, namespace, plural, body, _request_timeout=REQUEST_TIMEOUT
        ),
        exists_ok=True,
    )


def listing(crds, namespace: str, plural: str, group: tuple[str, str] = (GROUP, VERSION)) -> list[dict]:
    return retrying(
        lambda: crds.list_namespaced_custom_object(*group, namespace, plural, _request_timeout=REQUEST_TIMEOUT)
    )["items"]


def obj(kind: str, name: str, spec: dict) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": {"name": name}, "spec": spec}


def session_body(name: str, template: dict = KWOK_POD) -> dict:
    spec = {"podTemplate": template, "workspace": {"size": "64Mi"}, "harness": {"name": "h", "revision": "1"}}
    return obj("Session", name, spec)


def phases(crds, namespace: str, plural: str) -> dict[str, str | None]:
    return {o["metadata"]["name"]: (o.get("status") or {}).get("phase") for o in listing(crds, namespace, plural)}


# --- the mixed workload -------------------------------------------------------------


class Workload:
    """Mixed checkpoint / fork / at-event fork / rollback / delete / append operations on a few sessions."""

    KINDS = ("checkpoint", "fork", "at_event", "rollback", "delete", "append")
    WEIGHTS = (35, 18, 12, 15, 5, 15)

    def __init__(self, core, crds, namespace: str, rng: random.Random, sessions: list[str]) -> None:
        self.core, self.crds, self.namespace, self.rng = core, crds, namespace, rng
        self.sessions = sessions
        self.checkpoints: list[str] = []
        self.forks: list[str] = []
        self.deleted: set[str] = set()
        self.used: set[str] = set()  # checkpoints a fork or rollback names: never deleted
        self.counts: Counter[str] = Counter()
        self.issued = 0

    def log(self, session: str) -> EventLog:
        return EventLog(self.core, self.namespace, session)

    def ready_checkpoints(self) -> list[str]:
        now = phases(self.crds, self.namespace, "checkpoints")
        return [c for c in self.checkpoints if now.get(c) == "Ready" and c not in self.deleted]

    def step(self, i: int) -> None:
        kind = self.rng.choices(self.KINDS, self.WEIGHTS)[0]
        ready = self.ready_checkpoints() if kind in ("fork", "rollback", "delete") else []
        deadline = time.monotonic() + 30
        while kind in ("fork", "rollback") and not ready and self.checkpoints and time.monotonic() < deadline:
            time.sleep(0.5)  # the operator may be down: wait for a checkpoint to fork from
            ready = self.ready_checkpoints()
        if kind in ("fork", "rollback") and not ready:
            kind = "checkpoint"
        deletable = [c for c in self.checkpoints if c not in self.used and c not in self.deleted]
        if kind == "delete" and not deletable:
            kind = "append"
        self.counts[kind] += 1
        ns = self.namespace
        if kind == "checkpoint":
            name = f"c{i}"
            session = self.rng.choice(self.sessions)
            self.checkpoints.append(name)
            create(self.crds, ns, "checkpoints", obj("Checkpoint", name, {"sessionName": session, "label": f"op {i}"}))
        elif kind in ("fork", "rollback"):
            checkpoint = self.rng.choice(ready)
            self.used.add(checkpoint)
            name = f"{'fk' if kind == 'fork' else 'rb'}{i}"
            spec: dict[str, Any] = {"source": {"checkpoint": checkpoint}}
            if kind == "fork":
                spec["target"] = {"sessionName": f"f{i}"}
            else:
                spec["mode"] = "Rollback"
            self.forks.append(name)
            create(self.crds, ns, "forks", obj("Fork", name, spec))
        elif kind == "at_event":
            session = self.rng.choice(self.sessions)
            last = retrying(lambda: self.log(session).cursor().seq)
            if last == 0:
                last = retrying(lambda: self.log(session).append("user.message", {"text": "hello"}).seq)
            name = f"ae{i}"
            self.forks.append(name)
            source = {"session": session, "atEvent": str(self.rng.randint(1, last))}
            create(self.crds, ns, "forks", obj("Fork", name, {"source": source, "target": {"sessionName": f"f{i}"}}))
        elif kind == "delete":
            victim = self.rng.choice(deletable)
            self.deleted.add(victim)
            retrying(lambda: _delete_checkpoint(self.crds, ns, victim))
        else:
            session = self.rng.choice(self.sessions)
            retrying(lambda: self.log(session).append("user.message", {"text": f"op {i}"}))

    def run(self, n: int, pause: tuple[float, float] = (0.1, 0.8)) -> None:
        for _ in range(n):
            self.step(self.issued)  # numbered across runs: names never repeat
            self.issued += 1
            time.sleep(self.rng.uniform(*pause))


def _delete_checkpoint(crds, namespace: str, name: str) -> None:
    try:
        crds.delete_namespaced_custom_object(
            GROUP, VERSION, namespace, "checkpoints", name, _request_timeout=REQUEST_TIMEOUT
        )
    except client.ApiException as err:
        if err.status != 404:
            raise


def start_sessions(
    core, crds, namespace: str, names: list[str], timeout: float = 120, template: dict = KWOK_POD
) -> None:
    """Sessions Ready, each with a small conversation and an identity file in its workspace."""
    for name in names:
        create(crds, namespace, "sessions", session_body(name, template))
    for name in names:
        wait_for(
            lambda n=name: phases(crds, namespace, "sessions").get(n) == "Ready",
            timeout=timeout,
            interval=0.5,
            what=f"session {name} Ready",
        )
        log = EventLog(core, namespace, name)
        log.append("user.message", {"text": f"I am {name}"})
        log.append("run.started", {"runId": "r0"})
        log.append("run.completed", {"runId": "r0"})
        try:
            claim = crds.get_namespaced_custom_object(GROUP, VERSION, namespace, "sessions", name)["status"][
                "workspaceClaimName"
            ]
            (pvc_data_dir(core, namespace, claim) / "identity").write_text(name)
        except PVCDataError:
            pass  # a cluster whose volumes are not on this machine: no file checks
    for name in names:
        wait_for(
            lambda n=name: phases(crds, namespace, "sessions").get(n) == "Ready",
            timeout=timeout,
            interval=0.5,
            what=f"session {name} Ready after its first run",
        )


# --- the invariants -----------------------------------------------------------------


def snapshot_owner(vs: dict) -> str | None:
    """The Checkpoint a VolumeSnapshot is of: its name in the label, or whole in the
    annotation when the name is longer than a label value may be."""
    meta = vs["metadata"]
    return (meta.get("annotations") or {}).get(CHECKPOINT_LABEL) or (meta.get("labels") or {}).get(CHECKPOINT_LABEL)


def problems(core, crds, namespace: str, work: Workload) -> list[str]:
    """Everything wrong with the namespace after a run; empty when every invariant holds."""
    found: list[str] = []
    ckpts = {c["metadata"]["name"]: c for c in listing(crds, namespace, "checkpoints")}
    forks = {f["metadata"]["name"]: f for f in listing(crds, namespace, "forks")}
    sessions = {s["metadata"]["name"]: s for s in listing(crds, namespace, "sessions")}

    # 1. Every object reaches a terminal phase (deleted checkpoints are gone).
    for name in work.checkpoints:
        if name in work.deleted:
            if name in ckpts:
                found.append(f"checkpoint {name} was deleted but is still there")
            continue
        phase = (ckpts.get(name, {}).get("status") or {}).get("phase")
        if phase not in CHECKPOINT_TERMINAL:
            found.append(f"checkpoint {name} is {phase or 'missing'}")
    for name in work.forks:
        phase = (forks.get(name, {}).get("status") or {}).get("phase")
        if phase not in FORK_TERMINAL:
            found.append(f"fork {name} is {phase or 'missing'}")
    for name, body in sessions.items():
        if RESTORING_ANNOTATION in (body["metadata"].get("annotations") or {}):
            found.append(f"session {name} is still marked as rolling back")
        if (body.get("status") or {}).get("phase") in (None, "Provisioning"):
            found.append(f"session {name} is still {(body.get('status') or {}).get('phase') or 'new'}")

    # 2. VolumeSnapshots: each belongs to an existing checkpoint, at most one per checkpoint.
    snaps = listing(crds, namespace, "volumesnapshots", SNAP)
    by_ckpt: defaultdict[str, list[str]] = defaultdict(list)
    for vs in snaps:
        owner = snapshot_owner(vs)
        if owner is None:
            found.append(f"VolumeSnapshot {vs['metadata']['name']} has no {CHECKPOINT_LABEL} label")
            continue
        by_ckpt[owner].append(vs["metadata"]["name"])
    for owner, names in by_ckpt.items():
        if owner not in ckpts:
            found.append(f"VolumeSnapshot {names} is orphaned: checkpoint {owner} does not exist")
        if len(names) > 1:
            found.append(f"checkpoint {owner} has {len(names)} VolumeSnapshots: {names}")
    # ... and each VolumeSnapshotContent bound to this namespace still has its VolumeSnapshot
    # (the orphans that outlive a backup tool: a disk snapshot nobody can see or delete).
    snap_names = {vs["metadata"]["name"] for vs in snaps}
    contents = retrying(
        lambda: crds.list_cluster_custom_object(*SNAP, "volumesnapshotcontents", _request_timeout=REQUEST_TIMEOUT)
    )["items"]
    for content in contents:
        ref = content["spec"].get("volumeSnapshotRef") or {}
        if ref.get("namespace") == namespace and ref.get("name") not in snap_names:
            found.append(
                f"VolumeSnapshotContent {content['metadata']['name']} is orphaned: "
                f"VolumeSnapshot {ref.get('name')} does not exist"
            )
    for name, body in ckpts.items():
        status = body.get("status") or {}
        snaps_of = by_ckpt.get(name, [])
        if status.get("phase") == "Ready":
            if snaps_of != [status.get("volumeSnapshotName")] or snaps_of != [snapshot_name(name)]:
                found.append(f"Ready checkpoint {name} has VolumeSnapshots {snaps_of}")
        elif status.get("phase") in ("Rejected", "Expired") and snaps_of:
            found.append(f"{status['phase']} checkpoint {name} still has VolumeSnapshots {snaps_of}")

    # 3. PVCs and log chunks: each is the current claim / a log chunk of an existing session, owned by it.
    claims = {(s.get("status") or {}).get("workspaceClaimName"): s for s in sessions.values()}
    for pvc in retrying(
        lambda: core.list_namespaced_persistent_volume_claim(
            namespace, label_selector=SESSION_LABEL, _request_timeout=REQUEST_TIMEOUT
        )
    ).items:
        if pvc.metadata.deletion_timestamp:
            continue
        owner = claims.get(pvc.metadata.name)
        if owner is None:
            found.append(f"PVC {pvc.metadata.name} (session {pvc.metadata.labels[SESSION_LABEL]}) is orphaned")
        elif [r.uid for r in pvc.metadata.owner_references or []] != [owner["metadata"]["uid"]]:
            found.append(f"PVC {pvc.metadata.name} is not owned by its session")
    for cm in retrying(
        lambda: core.list_namespaced_config_map(
            namespace, label_selector=SESSION_LABEL, _request_timeout=REQUEST_TIMEOUT
        )
    ).items:
        session = sessions.get(cm.metadata.labels[SESSION_LABEL])
        if session is None or session["metadata"]["uid"] not in [r.uid for r in cm.metadata.owner_references or []]:
            found.append(f"log chunk {cm.metadata.name} is orphaned")

    # 4. Every log reads 1..N; no operator event is written twice, none that should be there is
    # missing. A fork copies its parent's prefix, events included, so count within each log.
    created: dict[tuple[str, str], list[int]] = defaultdict(list)  # (session, checkpoint uid) -> seqs
    rolled: dict[tuple[str, str], list[int]] = defaultdict(list)  # (session, fork uid) -> seqs
    for name in sessions:
        events = retrying(lambda n=name: EventLog(core, namespace, n).read(partial=True))
        seqs = [e.seq for e in events]
        if seqs != list(range(1, len(seqs) + 1)):
            found.append(f"log of {name} has gaps or disorder: {seqs}")
        for e in events:
            if e.type == "checkpoint.created":
                created[(name, e.data.get("uid"))].append(e.seq)
            elif e.type == "session.rollback":
                rolled[(name, e.data.get("fork"))].append(e.seq)
        forked = [e.seq for e in events if e.type == "session.forked"]
        if len(forked) > 1:
            found.append(f"log of {name} has session.forked at seq {forked}")
        forked_and_up = sessions[name]["spec"].get("source") and sessions[name].get("status", {}).get("phase") in LIVE
        if forked_and_up and len(forked) != 1:
            found.append(f"forked session {name} is up but its log has session.forked at seq {forked}")
    for (session, uid), at in [*created.items(), *rolled.items()]:
        if len(at) > 1:
            found.append(f"log of {session} has the event of uid {uid} {len(at)} times, at seq {at}")
    for name, body in ckpts.items():
        own = created.get((body["spec"]["sessionName"], body["metadata"]["uid"]), [])
        if (body.get("status") or {}).get("phase") == "Ready" and len(own) != 1:
            found.append(f"Ready checkpoint {name}: its session's log has checkpoint.created at seq {own}")
    for name, body in forks.items():
        target = (body.get("status") or {}).get("targetSession")
        own = rolled.get((target, body["metadata"]["uid"]), [])
        if (
            body["spec"].get("mode") == "Rollback"
            and (body.get("status") or {}).get("phase") == "Succeeded"
            and len(own) != 1
        ):
            found.append(f"Succeeded rollback {name}: the log of {target} has session.rollback at seq {own}")

    # 5. Succeeded forks made Ready sessions; a checkpoint's data went where the fork took it.
    for name, body in forks.items():
        status = body.get("status") or {}
        if status.get("phase") != "Succeeded":
            continue
        target = sessions.get(status.get("targetSession"))
        if target is None:
            found.append(f"fork {name} Succeeded but session {status.get('targetSession')} does not exist")
            continue
        source = body["spec"]["source"].get("checkpoint")
        if source and source in ckpts and target["status"].get("phase") in LIVE:
            expected = ckpts[source]["spec"]["sessionName"]
            identity = _identity(core, namespace, target["status"].get("workspaceClaimName"))
            if identity not in (None, expected):
                found.append(
                    f"fork {name}: workspace of {target['metadata']['name']} holds {identity!r}, not {expected!r}"
                )
    return found


def _identity(core, namespace: str, claim: str | None) -> str | None:
    """The identity file of a workspace; None when it cannot be read from here."""
    if not claim:
        return None
    try:
        return (pvc_data_dir(core, namespace, claim) / "identity").read_text()
    except (PVCDataError, client.ApiException):
        return None
    except FileNotFoundError:
        return "(no identity file)"


def settle(core, crds, namespace: str, work: Workload, timeout: float, seed_value: int, proc: OperatorProcess) -> float:
    """Wait until every invariant holds; seconds it took. Fails listing what is still wrong,
    with what the stuck objects and the operator's log say about them (CI keeps no files)."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        found = problems(core, crds, namespace, work)
        if not found:
            return time.monotonic() - started
        if time.monotonic() > deadline:
            pytest.fail(
                f"after {timeout:.0f}s (seed {seed_value}) these invariants still fail:\n  "
                + "\n  ".join(found)
                + "\n"
                + diagnosis(core, crds, namespace, found, proc.log_path),
                pytrace=False,
            )
        time.sleep(2)


STUCK = re.compile(r"^(?:session|fork|checkpoint) (\S+) ")


def diagnosis(core, crds, namespace: str, found: list[str], log_path: Path, lines: int = 15) -> str:
    """The status, VolumeSnapshot, claim and Pod of each object a problem names, and the
    operator's last log lines about it."""
    out = []
    names = sorted({m.group(1) for m in map(STUCK.match, found) if m})
    for plural in ("sessions", "forks", "checkpoints"):
        for o in listing(crds, namespace, plural):
            if o["metadata"]["name"] in names:
                deleting = " (being deleted)" if o["metadata"].get("deletionTimestamp") else ""
                out.append(f"{plural} {o['metadata']['name']}{deleting}: status {o.get('status')}")
    for vs in listing(crds, namespace, "volumesnapshots", SNAP):
        if snapshot_owner(vs) in names:
            meta = vs["metadata"]
            deleting = " (being deleted)" if meta.get("deletionTimestamp") else ""
            finalizers = meta.get("finalizers")
            out.append(f"VolumeSnapshot {meta['name']}{deleting}: finalizers {finalizers}, status {vs.get('status')}")
    for pvc in core.list_namespaced_persistent_volume_claim(namespace, _request_timeout=REQUEST_TIMEOUT).items:
        if (pvc.metadata.labels or {}).get(SESSION_LABEL) in names:
            deleting = " (being deleted)" if pvc.metadata.deletion_timestamp else ""
            out.append(f"claim {pvc.metadata.name}: {pvc.status.phase}{deleting}")
    for pod in core.list_namespaced_pod(namespace, _request_timeout=REQUEST_TIMEOUT).items:
        if (pod.metadata.labels or {}).get(SESSION_LABEL) in names:
            out.append(f"pod {pod.metadata.name}: {pod.status.phase}")
    text = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    for name in names:
        about = [line for line in text if f"/{name}" in line or f"'{name}'" in line or f" {name} " in line]
        out.append(f"operator log about {name} (last {lines} of {len(about)} lines, {log_path}):")
        out.extend("    " + line[:400] for line in about[-lines:])
    return "\n".join(out)


def outcome_summary(crds, namespace: str) -> str:
    """Counts by phase/reason, with one message for each reason (why were they refused?)."""
    out = []
    for plural in ("checkpoints", "forks"):
        counts: Counter[str] = Counter()
        example: dict[str, str] = {}
        for o in listing(crds, namespace, plural):
            status = o.get("status") or {}
            key = f"{status.get('phase')}" + (f"/{status['reason']}" if status.get("reason") else "")
            counts[key] += 1
            if status.get("reason"):
                example.setdefault(key, status.get("message") or "")
        out.append(
            f"{plural}: "
            + ", ".join(
                f"{k} {v}" + (f" (e.g. {example[k]!r})" if k in example else "") for k, v in sorted(counts.items())
            )
        )
    return "; ".join(out)


# --- restarts of the local control plane ------------------------------------------


def run_dir_of(kubeconfig: str) -> Path | None:
    """The hack/cluster run folder behind a kubeconfig, when it is one."""
    folder = Path(kubeconfig).resolve().parent
    return folder if (folder / "state.json").exists() and (folder / "pids").is_dir() else None


def restart_component(run_dir: Path, component: str) -> float:
    started = time.monotonic()
    result = subprocess.run(
        [str(REPO / "hack" / "cluster"), "restart", component, "--kill"],
        env={**os.environ, "SAVEPOINT_RUN_DIR": str(run_dir)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, f"hack/cluster restart {component} failed:\n{result.stderr}"
    return time.monotonic() - started


def pod_uid(core, namespace: str, session: str) -> str | None:
    try:
        return core.read_namespaced_pod(pod_name(session), namespace, _request_timeout=REQUEST_TIMEOUT).metadata.uid
    except client.ApiException as err:
        if err.status == 404:
            return None
        raise
