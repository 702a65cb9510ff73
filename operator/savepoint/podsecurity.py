"""Pure checks of a Session's podTemplate against the Kubernetes Pod Security Standards.

The operator creates sandbox Pods under its own ServiceAccount, so without these checks
anyone who may create a Session could get a Pod they may not create themselves (a
confused deputy). Every Pod is checked before it is made, at the level its namespace
asks for (docs/security.md):

- `savepoint.dev/pod-security` (namespace label): `baseline` (the default), `restricted`,
  or `privileged` (no check). Setting a namespace's labels takes `patch` on the
  Namespace object, which a cluster admin grants and a namespace's own users lack.
- `pod-security.kubernetes.io/enforce` (Pod Security Admission's own label) can only
  make it stricter: `restricted` there means `restricted` here.

The rules follow https://kubernetes.io/docs/concepts/security/pod-security-standards/.
Each problem names the field (as a path under `spec.podTemplate`) and the rule. Nothing
here talks to the API server.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from savepoint.constants import POD_SECURITY_LABEL

PSA_ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
LEVELS = ("privileged", "baseline", "restricted")  # loosest to strictest
DEFAULT_LEVEL = "baseline"

# Capabilities a baseline container may add (the standard's list).
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
# The "safe" sysctls the standard allows at baseline.
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
        "net.ipv4.tcp_rmem",
        "net.ipv4.tcp_wmem",
    }
)
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
RESTRICTED_VOLUMES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")
ROOT = "spec.podTemplate"


@dataclass(frozen=True)
class Problem:
    field: str  # e.g. spec.podTemplate.spec.containers[0].securityContext.privileged
    rule: str  # what the standard (or the sandbox) requires

    def __str__(self) -> str:
        return f"{self.field}: {self.rule}"


def level_for(labels: dict[str, str] | None) -> str:
    """The level a namespace's labels ask for: the stricter of Savepoint's own label
    (default baseline) and Pod Security Admission's enforce label."""
    labels = labels or {}
    own = labels.get(POD_SECURITY_LABEL, DEFAULT_LEVEL)
    if own not in LEVELS:
        own = "restricted"  # a typo never loosens
    psa = labels.get(PSA_ENFORCE_LABEL, "privileged")
    if psa not in LEVELS:
        psa = "privileged"
    return max(own, psa, key=LEVELS.index)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _containers(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in CONTAINER_LISTS:
        for i, container in enumerate(_list(spec.get(kind))):
            if isinstance(container, dict):
                yield f"{ROOT}.spec.{kind}[{i}]", container


def check_account(template: dict[str, Any], own_account: str) -> list[Problem]:
    """A sandbox runs as its own ServiceAccount: any other name is refused (at every level)."""
    spec = _dict(template.get("spec"))
    problems = []
    for key in ("serviceAccountName", "serviceAccount"):
        name = spec.get(key)
        if name is not None and name != own_account:
            problems.append(
                Problem(
                    f"{ROOT}.spec.{key}",
                    f"a sandbox runs as its own ServiceAccount {own_account} (the only one that gets a token); "
                    f"leave it unset, not {name!r}",
                )
            )
    return problems


def check(template: dict[str, Any], level: str) -> list[Problem]:
    """Every way the template breaks the Pod Security Standard `level`; empty when it passes."""
    if level == "privileged":
        return []
    problems = _baseline(template)
    if level == "restricted":
        problems += _restricted(template)
    return problems


def _baseline(template: dict[str, Any]) -> list[Problem]:
    out: list[Problem] = []
    spec = _dict(template.get("spec"))
    pod_sc = _dict(spec.get("securityContext"))
    base = f"{ROOT}.spec"
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key) is True:
            out.append(Problem(f"{base}.{key}", "must be unset or false (baseline: no host namespaces)"))
    for i, volume in enumerate(_list(spec.get("volumes"))):
        if isinstance(volume, dict) and "hostPath" in volume:
            out.append(Problem(f"{base}.volumes[{i}].hostPath", "is not allowed (baseline: no hostPath volumes)"))
    out += _security_context(f"{base}.securityContext", pod_sc, pod_level=True)
    for i, sysctl in enumerate(_list(pod_sc.get("sysctls"))):
        name = _dict(sysctl).get("name")
        if name not in SAFE_SYSCTLS:
            out.append(
                Problem(
                    f"{base}.securityContext.sysctls[{i}].name",
                    f"{name!r} is not one of the safe sysctls (baseline): {', '.join(sorted(SAFE_SYSCTLS))}",
                )
            )
    for where, container in _containers(spec):
        sc = _dict(container.get("securityContext"))
        scp = f"{where}.securityContext"
        if sc.get("privileged") is True:
            out.append(Problem(f"{scp}.privileged", "must be unset or false (baseline: no privileged containers)"))
        added = [c for c in _list(_dict(sc.get("capabilities")).get("add")) if c not in BASELINE_CAPABILITIES]
        if added:
            out.append(
                Problem(
                    f"{scp}.capabilities.add",
                    f"{', '.join(map(str, added))} may not be added (baseline allows only "
                    f"{', '.join(sorted(BASELINE_CAPABILITIES))})",
                )
            )
        if sc.get("procMount") not in (None, "Default"):
            out.append(Problem(f"{scp}.procMount", "must be unset or Default (baseline: the default /proc mask)"))
        out += _security_context(scp, sc, pod_level=False)
        for j, port in enumerate(_list(container.get("ports"))):
            if _dict(port).get("hostPort") not in (None, 0):
                out.append(Problem(f"{where}.ports[{j}].hostPort", "must be unset or 0 (baseline: no host ports)"))
    annotations = _dict(_dict(template.get("metadata")).get("annotations"))
    for key, value in annotations.items():
        apparmor = key.startswith("container.apparmor.security.beta.kubernetes.io/")
        if apparmor and value != "runtime/default" and not str(value).startswith("localhost/"):
            out.append(
                Problem(
                    f"{ROOT}.metadata.annotations[{key}]",
                    "must be runtime/default or localhost/<profile> (baseline: AppArmor not unconfined)",
                )
            )
    return out


def _security_context(path: str, sc: dict[str, Any], pod_level: bool) -> list[Problem]:
    """The rules that apply alike to the Pod's and to each container's securityContext."""
    out = []
    if _dict(sc.get("windowsOptions")).get("hostProcess") is True:
        out.append(Problem(f"{path}.windowsOptions.hostProcess", "must be unset or false (baseline: no HostProcess)"))
    apparmor = _dict(sc.get("appArmorProfile")).get("type")
    if apparmor not in (None, "RuntimeDefault", "Localhost"):
        out.append(
            Problem(f"{path}.appArmorProfile.type", "must be RuntimeDefault or Localhost (baseline: not Unconfined)")
        )
    selinux = _dict(sc.get("seLinuxOptions"))
    if selinux.get("type", "") not in SELINUX_TYPES:
        out.append(
            Problem(
                f"{path}.seLinuxOptions.type",
                f"must be one of {', '.join(sorted(t for t in SELINUX_TYPES if t))} (baseline)",
            )
        )
    for key in ("user", "role"):
        if selinux.get(key, "") != "":
            out.append(Problem(f"{path}.seLinuxOptions.{key}", "must be unset (baseline)"))
    seccomp = _dict(sc.get("seccompProfile")).get("type")
    if seccomp == "Unconfined":
        out.append(Problem(f"{path}.seccompProfile.type", "must not be Unconfined (baseline)"))
    return out


def _restricted(template: dict[str, Any]) -> list[Problem]:
    out: list[Problem] = []
    spec = _dict(template.get("spec"))
    pod_sc = _dict(spec.get("securityContext"))
    base = f"{ROOT}.spec"
    for i, volume in enumerate(_list(spec.get("volumes"))):
        kinds = [k for k in _dict(volume) if k != "name"]
        bad = [k for k in kinds if k not in RESTRICTED_VOLUMES and k != "hostPath"]  # hostPath: said at baseline
        if bad:
            out.append(
                Problem(
                    f"{base}.volumes[{i}].{bad[0]}",
                    f"is not allowed (restricted allows only {', '.join(sorted(RESTRICTED_VOLUMES))} volumes)",
                )
            )
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    pod_seccomp = _dict(pod_sc.get("seccompProfile")).get("type") in ("RuntimeDefault", "Localhost")
    if pod_sc.get("runAsUser") == 0:
        out.append(Problem(f"{base}.securityContext.runAsUser", "must not be 0 (restricted: not root)"))
    for where, container in _containers(spec):
        sc = _dict(container.get("securityContext"))
        scp = f"{where}.securityContext"
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(Problem(f"{scp}.allowPrivilegeEscalation", "must be false (restricted)"))
        non_root = sc.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            out.append(
                Problem(f"{scp}.runAsNonRoot", "must be true, here or in spec.securityContext (restricted: not root)")
            )
        if sc.get("runAsUser") == 0:
            out.append(Problem(f"{scp}.runAsUser", "must not be 0 (restricted: not root)"))
        seccomp = _dict(sc.get("seccompProfile")).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost") and not (seccomp is None and pod_seccomp):
            out.append(
                Problem(
                    f"{scp}.seccompProfile.type",
                    "must be RuntimeDefault or Localhost, here or in spec.securityContext (restricted)",
                )
            )
        caps = _dict(sc.get("capabilities"))
        if "ALL" not in _list(caps.get("drop")):
            out.append(Problem(f"{scp}.capabilities.drop", "must include ALL (restricted)"))
        extra = [c for c in _list(caps.get("add")) if c != "NET_BIND_SERVICE" and c in BASELINE_CAPABILITIES]
        if extra:
            out.append(
                Problem(
                    f"{scp}.capabilities.add",
                    f"{', '.join(map(str, extra))} may not be added (restricted allows only NET_BIND_SERVICE)",
                )
            )
    return out


def refusal(template: dict[str, Any], level: str, own_account: str) -> str | None:
    """None when a Pod may be made from the template at `level`; else one message naming
    every field that breaks a rule, and the rule (for a status or an admission answer)."""
    problems = check_account(template, own_account) + check(template, level)
    if not problems:
        return None
    return f"{'; '.join(map(str, problems))} (Pod Security Standard {level}; see docs/security.md)"
