"""The validating admission webhook's handlers: the status path's checks, answered at
`kubectl apply` time. Registered only when SAVEPOINT_WEBHOOK is on (`python -m savepoint`
imports this module then): kopf refuses to start with admission handlers and no server."""

from __future__ import annotations

import kopf

from savepoint.controllers import checkpoint
from savepoint.controllers import session as sessions
from savepoint.models import GROUP, VERSION, CheckpointSpec

# The HTTP status of each refusal that is not a conflict (409).
REFUSAL_CODES = {"SnapshotsUnsupported": 501, "HooksDisabled": 501, "SessionNotFound": 404}


@kopf.on.validate(GROUP, VERSION, "checkpoints", id="validate-checkpoints", operations=["CREATE"])
def checkpoint_admission(namespace: str, name: str, spec: kopf.Spec, memo: kopf.Memo, **_: object) -> None:
    """Refuse at once what cannot change (DESIGN 2); what can still happen waits in status."""
    rejection = checkpoint.check(namespace, name, CheckpointSpec.model_validate(dict(spec)), memo.runtime.settings)
    if rejection is not None:
        code = REFUSAL_CODES.get(rejection.reason, 409)
        raise kopf.AdmissionError(f"{rejection.reason}: {rejection.message}", code=code)


@kopf.on.validate(GROUP, VERSION, "sessions", id="validate-sessions", operations=["CREATE", "UPDATE"])
def session_admission(namespace: str, name: str, spec: kopf.Spec, old: kopf.Body | None, **_: object) -> None:
    """The Pod Security check of the status path. An update is checked only when it changes
    the template: a Session admitted before can still be paused or resumed."""
    template = dict(spec).get("podTemplate") or {}
    if old is not None and (dict(old).get("spec") or {}).get("podTemplate") == template:
        return
    refusal = sessions.pod_security_refusal(namespace, name, template)
    if refusal:
        raise kopf.AdmissionError(f"PodTemplateForbidden: {refusal}", code=403)
