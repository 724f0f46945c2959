"""Plain-JSON access to the Kubernetes API over one kubernetes-asyncio ApiClient.

Owns paths, status codes and watch streams; objects stay dicts (no model round trips, nothing
dropped). Errors become ApiError with the server's reason and message; a 410 (HTTP or a watch
ERROR event) becomes Gone so that informers know to re-list.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from kubernetes_asyncio.client import ApiClient

from shared.kube.rest import ApiError, Gone, decode, list_pages, request, watch_lines

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True)
class Resource:
    """One API resource: where it lives and how it is addressed."""

    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    def at(self, version: str) -> Resource:
        """The same resource at another API version (resource.k8s.io's v1 or v1beta1)."""
        return Resource(self.group, version, self.plural, self.kind, self.namespaced)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if subresource:
            base += f"/{subresource}"
        return base


PODS = Resource("", "v1", "pods", "Pod")
REPLICASETS = Resource("apps", "v1", "replicasets", "ReplicaSet")
DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment")
JOBS = Resource("batch", "v1", "jobs", "Job")
NODES = Resource("", "v1", "nodes", "Node", namespaced=False)
NAMESPACES = Resource("", "v1", "namespaces", "Namespace", namespaced=False)
EVENTS = Resource("", "v1", "events", "Event")
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease")
RESOURCECLAIMS = Resource("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim")
RESOURCECLAIMTEMPLATES = Resource("resource.k8s.io", "v1", "resourceclaimtemplates", "ResourceClaimTemplate")
RESOURCESLICES = Resource("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", namespaced=False)
DEVICECLASSES = Resource("resource.k8s.io", "v1", "deviceclasses", "DeviceClass", namespaced=False)


def _error(status: int, body: Any) -> ApiError:
    if isinstance(body, dict) and body.get("kind") == "Status":
        reason, message = str(body.get("reason") or ""), str(body.get("message") or "")
    else:
        reason, message = "", str(body)[:500]
    cls = Gone if status == 410 else ApiError
    return cls(status, reason or "Error", message)


class Kube:
    """The few verbs controllers need, on dicts."""

    def __init__(self, api_client: ApiClient, request_timeout: float = 30.0) -> None:
        self.api_client = api_client
        self.request_timeout = request_timeout

    async def _call(
        self,
        method: str,
        path: str,
        query: list[tuple[str, Any]] | None = None,
        body: Any = None,
        content_type: str = JSON,
        timeout: float | None = None,
    ) -> Any:
        """One request through `shared.kube.rest.request` (no model walk of the body), the answer decoded with
        msgspec (bytes to dicts, no text decoding first); ApiError (Gone on 410) for a refusal."""
        raw = await request(
            self.api_client,
            method,
            path,
            query=[(k, str(v)) for k, v in query or []],
            body=body,
            timeout=timeout or self.request_timeout,
            content_type=content_type,
        )
        try:
            return decode(raw) if raw else None
        except msgspec.DecodeError:
            return raw.decode("utf-8", "replace")

    async def list(
        self,
        res: Resource,
        namespace: str | None = None,
        label_selector: str | None = None,
        page_size: int = 500,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        field_selector: str | None = None,
    ) -> tuple[list[dict[str, Any]], str]:
        """Every object (following `continue`), each through `transform` as its page arrives (a big list is
        never held whole), and the list's resourceVersion."""
        query = [
            (name, value)
            for name, value in (("labelSelector", label_selector), ("fieldSelector", field_selector))
            if value
        ]
        items: list[dict[str, Any]] = []
        version = ""
        async for page in list_pages(
            self.api_client,
            res.path(namespace),
            dict[str, Any],
            query=query,
            page_size=page_size,
            timeout=self.request_timeout,
        ):
            items.extend(map(transform, page.items) if transform is not None else page.items)
            version = version or page.metadata.resourceVersion
        return items, version

    async def watch(
        self, res: Resource, resource_version: str, timeout_s: int = 300, field_selector: str | None = None
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(type, object) events from `resource_version` (bookmarks included) until the server ends the stream
        (`shared.kube.rest.watch_lines`); an ERROR event raises its Status as ApiError (Gone for 410)."""
        query = [("fieldSelector", field_selector)] if field_selector else None
        async for line in watch_lines(
            self.api_client,
            res.path(),
            resource_version=resource_version,
            query=query,
            timeout_s=timeout_s,
            connect_timeout_s=self.request_timeout,
        ):
            event = decode(line)
            kind, obj = event.get("type", ""), event.get("object") or {}
            if kind == "ERROR":
                raise _error(int(obj.get("code") or 500), obj)
            yield kind, obj

    async def get(self, res: Resource, namespace: str | None, name: str) -> dict[str, Any]:
        data: dict[str, Any] = await self._call("GET", res.path(namespace, name))
        return data

    async def create(self, res: Resource, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
        data: dict[str, Any] = await self._call("POST", res.path(namespace), body=body)
        return data

    async def create_subresource(
        self, res: Resource, namespace: str | None, name: str, subresource: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """POST to a subresource (pods/binding, pods/eviction)."""
        data: dict[str, Any] = await self._call("POST", res.path(namespace, name, subresource), body=body)
        return data

    async def replace(self, res: Resource, obj: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        """PUT with the object's resourceVersion: a 409 means someone else wrote first."""
        md = obj["metadata"]
        data: dict[str, Any] = await self._call("PUT", res.path(md.get("namespace"), md["name"], subresource), body=obj)
        return data

    async def patch(
        self, res: Resource, namespace: str | None, name: str, patch: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        data: dict[str, Any] = await self._call(
            "PATCH", res.path(namespace, name, subresource), body=patch, content_type=MERGE_PATCH
        )
        return data

    async def delete(
        self, res: Resource, namespace: str | None, name: str, uid: str | None = None, propagation: str | None = None
    ) -> None:
        """Delete (with a uid precondition when given); an object already gone is not an error."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid:
            body["preconditions"] = {"uid": uid}
        if propagation:
            body["propagationPolicy"] = propagation
        try:
            await self._call("DELETE", res.path(namespace, name), body=body)
        except ApiError as exc:
            if exc.not_found:
                return
            raise
