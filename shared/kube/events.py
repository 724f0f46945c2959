"""Kubernetes Events (core/v1), the one way every service records one: what an SRE sees in
`kubectl describe` and `kubectl get events`. Recording never raises: a lost Event must not stop
the work it reports (it is logged instead)."""

from __future__ import annotations

import datetime
from typing import Any

from shared.kube.rest import request
from shared.logs import get_logger

log = get_logger(__name__)


async def record(api_client: Any, *, namespace: str, involved: dict[str, str], reason: str, message: str,
                 component: str, host: str = "", type_: str = "Normal") -> bool:
    """Create an Event about `involved` ({apiVersion, kind, name[, namespace, uid]}); False if it failed."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
        "apiVersion": "v1", "kind": "Event", "type": type_, "reason": reason, "message": message[:1024],
        "metadata": {"generateName": f"{involved.get('name', 'object')}.", "namespace": namespace},
        "involvedObject": involved, "source": {"component": component, **({"host": host} if host else {})},
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }
    try:
        await request(api_client, "POST", f"/api/v1/namespaces/{namespace}/events", body=body)
        return True
    except Exception as exc:  # noqa: BLE001 - see the module doc
        log.warning("cannot record a Kubernetes Event", reason=reason, object=involved.get("name"), error=str(exc))
        return False
