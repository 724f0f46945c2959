"""Which `resource.k8s.io` version a server serves: asked once, by every layer the same way.

Upstream serves v1 from Kubernetes 1.34, v1beta2 from 1.33 and v1beta1 on 1.32 (with the
DynamicResourceAllocation feature); the fields the driver reads have the same shape in all three.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shared.kube.rest import ApiError, get_json

RESOURCE_GROUP = "resource.k8s.io"
PREFERRED_VERSIONS = ("v1", "v1beta2", "v1beta1")


async def served_versions(api_client: Any, group: str = RESOURCE_GROUP) -> list[str]:
    """The versions of `group` the server serves (its APIGroup document); [] when it serves none."""
    try:
        doc = await get_json(api_client, f"/apis/{group}")
    except ApiError as exc:
        if exc.not_found:
            return []
        raise
    versions = doc.get("versions") if isinstance(doc, dict) else None
    return [str(v.get("version")) for v in (versions if isinstance(versions, list) else []) if isinstance(v, dict)]


def best_version(served: Iterable[str], preferred: Iterable[str] = PREFERRED_VERSIONS) -> str | None:
    """The first of `preferred` that is served; None when none is."""
    have = set(served)
    return next((v for v in preferred if v in have), None)
