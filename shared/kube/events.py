"""Kubernetes Events (core/v1) as upstream's components record them: one body shape, one writer.

Owns the Event body (involved object, reason, message, type, reporting component and instance,
first/last timestamps, count 1) and its best-effort write: an Event that cannot be written is
logged, never an error for the caller (the change it reports happened all the same).
"""

from __future__ import annotations

from typing import Any, Literal

from shared.kube import rest
from shared.kube.timestamps import k8s_time
from shared.logs import get_logger

log = get_logger(__name__)

EventType = Literal["Normal", "Warning"]
CLUSTER_SCOPED_NAMESPACE = "default"  # where Events about cluster-scoped objects (Nodes) go, as upstream's


def event_body(
    involved: dict[str, Any], *, reason: str, message: str, type: EventType, component: str, instance: str = ""
) -> dict[str, Any]:
    """An Event about `involved` ({apiVersion, kind, name, uid[, namespace]})."""
    stamp = k8s_time()
    namespace = involved.get("namespace") or CLUSTER_SCOPED_NAMESPACE
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{involved.get('name')}.", "namespace": namespace},
        "involvedObject": involved,
        "reason": reason,
        "message": message[:1024],
        "type": type,
        "source": {"component": component, **({"host": instance} if instance else {})},
        "reportingComponent": component,
        "reportingInstance": instance or component,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


async def record_event(api_client: Any, body: dict[str, Any]) -> bool:
    """Write the Event (best effort, module doc); whether it was written."""
    namespace = body["metadata"]["namespace"]
    try:
        await rest.request(api_client, "POST", f"/api/v1/namespaces/{namespace}/events", body=body)
    except Exception as exc:  # noqa: BLE001 - module doc
        log.warning(
            "event not recorded",
            reason=body.get("reason"),
            object=f"{body['involvedObject'].get('kind')}/{body['involvedObject'].get('name')}",
            error=str(exc),
        )
        return False
    return True
