"""Create any manifest's objects through the API server, finding each kind's endpoint by discovery.

Owns multi-document YAML loading, resolving `apiVersion`+`kind` to a REST path via the server's
discovery documents (as kubectl does), default namespaces, and create-or-keep semantics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException


class ManifestError(ValueError):
    """A manifest document is malformed or names a kind the server does not serve."""


def load_documents(path: Path) -> list[dict[str, Any]]:
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    except (OSError, yaml.YAMLError) as exc:
        raise ManifestError(f"cannot read manifest {path}: {exc}") from exc
    for doc in docs:
        if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
            raise ManifestError(f"{path}: every document needs apiVersion and kind")
    return docs


class Applier:
    """`await Applier(api).create(obj)` -> the created (or existing) object."""

    def __init__(self, api: client.ApiClient):
        self.api = api
        self._resources: dict[str, dict[str, tuple[str, bool]]] = {}  # groupVersion -> kind -> (plural, ns)

    async def _get(self, path: str) -> Any:
        return await self._call(path, "GET")

    async def _call(self, path: str, method: str, body: Any = None) -> Any:
        return await self.api.call_api(
            path,
            method,
            body=body,
            header_params={"Content-Type": "application/json", "Accept": "application/json"},
            response_types_map={200: "object", 201: "object"},
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
        )

    async def _kinds(self, api_version: str) -> dict[str, tuple[str, bool]]:
        if api_version not in self._resources:
            base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            try:
                listing = await self._get(base)
            except ApiException as exc:
                raise ManifestError(f"the server does not serve {api_version} ({exc.status})") from exc
            self._resources[api_version] = {
                r["kind"]: (r["name"], bool(r.get("namespaced")))
                for r in listing.get("resources", [])
                if "/" not in r["name"]
            }
        return self._resources[api_version]

    def _base(self, api_version: str) -> str:
        return "/api/v1" if api_version == "v1" else f"/apis/{api_version}"

    async def path_for(self, obj: dict[str, Any], namespace: str = "default") -> str:
        kinds = await self._kinds(obj["apiVersion"])
        if obj["kind"] not in kinds:
            raise ManifestError(f"{obj['apiVersion']} has no kind {obj['kind']}; served: {', '.join(sorted(kinds))}")
        plural, namespaced = kinds[obj["kind"]]
        base = self._base(obj["apiVersion"])
        if namespaced:
            ns = (obj.get("metadata") or {}).get("namespace") or namespace
            return f"{base}/namespaces/{ns}/{plural}"
        return f"{base}/{plural}"

    async def _post(self, path: str, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The object created at `path`, or None when one of its name exists (409)."""
        try:
            return dict(await self._call(path, "POST", obj))
        except ApiException as exc:
            if exc.status != 409:
                raise ManifestError(
                    f"creating {obj['kind']} {obj.get('metadata', {}).get('name')}: {exc.status} {exc.body!r}"
                ) from exc
            return None

    async def create(self, obj: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
        path = await self.path_for(obj, namespace)
        created = await self._post(path, obj)
        return created if created is not None else dict(await self._get(f"{path}/{obj['metadata']['name']}"))

    async def create_or_replace(self, obj: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
        """Create `obj`, or replace the stored one with it (objects this program owns, whose definition may
        have changed since a data dir was made: the stored one must not keep rules that are gone)."""
        path = await self.path_for(obj, namespace)
        created = await self._post(path, obj)
        return (
            created if created is not None else dict(await self._call(f"{path}/{obj['metadata']['name']}", "PUT", obj))
        )

    async def apply_file(self, path: Path, namespace: str = "default") -> list[dict[str, Any]]:
        return [await self.create(doc, namespace) for doc in load_documents(path)]
