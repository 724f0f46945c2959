"""Validating admission webhooks: the server calls each registered ValidatingWebhookConfiguration as
kube-apiserver does.

Owns which webhooks a write goes to (`rules` with operations, versions and scope, `namespaceSelector`,
`objectSelector`, then `matchConditions` in CEL, a failed condition under `failurePolicy`), the call
(POST of an `admission.k8s.io/v1` AdmissionReview to `clientConfig.url`, or to a Service's
`https://<name>.<namespace>.svc:<port><path>`, verified against `caBundle` under that name; an
ExternalName Service is dialled at its external name, the local cluster's way to reach a process),
`timeoutSeconds` (default 10), and the outcome as upstream words it: a denial is the webhook's Status
(400 unless it names a code of 400 or more) with `admission webhook "<name>" denied the request: <message>`;
a call that fails is 500 `failed calling webhook "<name>": ...` under failurePolicy Fail, ignored under
Ignore.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import uuid
from typing import Any

import aiohttp
import msgspec

from embedded.apiserver import errors
from embedded.apiserver.admission import ADMISSION, CelFailure, labels_match, rule_matches, run_cel
from embedded.apiserver.authn import UserInfo
from embedded.apiserver.resources import Resource
from embedded.apiserver.storage import Store

CONFIGS = (ADMISSION, "validatingwebhookconfigurations")
DEFAULT_TIMEOUT = 10
_JSON = msgspec.json.Decoder()


class _CallFailed(Exception):
    pass


class WebhookAdmission:
    """Finds the webhooks a write matches and calls them; raises the refusal as an ApiError."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._contexts: dict[str, ssl.SSLContext] = {}
        self._session: aiohttp.ClientSession | None = None

    def may_apply(self, operation: str, res: Resource, version: str, subresource: str, namespaced: bool) -> bool:
        """Whether some webhook's rules name this write (cheap: the selectors and conditions come later)."""
        return any(
            rule_matches(r, res, version, operation, subresource, namespaced)
            for _, config in self.store.items(CONFIGS)
            for hook in config.get("webhooks") or []
            for r in hook.get("rules") or []
        )

    def matching(
        self,
        user: UserInfo,
        operation: str,
        res: Resource,
        version: str,
        subresource: str,
        namespace: str,
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
    ) -> list[dict[str, Any]]:
        """The webhooks to call, in configuration-name order; a matchCondition that fails to evaluate
        makes its webhook a failure (denial under Fail, skipped under Ignore), as upstream."""
        subject = obj if obj is not None else old or {}
        labels = (subject.get("metadata") or {}).get("labels") or {}
        ns_obj = self.store.get(("", "namespaces"), ("", namespace)) if namespace else None
        env = {
            "object": obj,
            "oldObject": old,
            "request": review_request(user, operation, res, version, subresource, namespace, subject, obj, old, False),
        }
        chosen = []
        for _, config in sorted(self.store.items(CONFIGS), key=lambda kv: kv[0]):
            for hook in config.get("webhooks") or []:
                if not any(
                    rule_matches(r, res, version, operation, subresource, bool(namespace))
                    for r in hook.get("rules") or []
                ):
                    continue
                if namespace and not labels_match(
                    hook.get("namespaceSelector"), ((ns_obj or {}).get("metadata") or {}).get("labels") or {}
                ):
                    continue
                if not labels_match(hook.get("objectSelector"), labels):
                    continue
                try:
                    if all(
                        run_cel(c.get("expression", "false"), env) is True for c in hook.get("matchConditions") or []
                    ):
                        chosen.append(hook)
                except CelFailure as exc:
                    if hook.get("failurePolicy", "Fail") != "Ignore":
                        raise errors.ApiError(
                            500,
                            "InternalError",
                            f"Internal error occurred: failed calling webhook "
                            f'"{hook.get("name", "")}": matchCondition failed: {exc}',
                        ) from None
        return chosen

    async def admit(
        self,
        user: UserInfo,
        operation: str,
        res: Resource,
        version: str,
        subresource: str,
        namespace: str,
        name: str,
        obj: dict[str, Any] | None,
        old: dict[str, Any] | None,
        dry_run: bool,
    ) -> None:
        """Call every matching webhook, concurrently as upstream; the first refusal (in order) is raised."""
        hooks = self.matching(user, operation, res, version, subresource, namespace, obj, old)
        if not hooks:
            return
        request = review_request(
            user, operation, res, version, subresource, namespace, {"metadata": {"name": name}}, obj, old, dry_run
        )
        outcomes = await asyncio.gather(*(self._call(hook, request) for hook in hooks))
        for refusal in outcomes:
            if refusal is not None:
                raise refusal

    async def _call(self, hook: dict[str, Any], request: dict[str, Any]) -> errors.ApiError | None:
        name = hook.get("name", "")
        uid = str(uuid.uuid4())
        body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {**request, "uid": uid}}
        try:
            response = await self._post(hook, body)
        except _CallFailed as exc:
            if hook.get("failurePolicy", "Fail") == "Ignore":
                return None
            return errors.ApiError(
                500, "InternalError", f'Internal error occurred: failed calling webhook "{name}": {exc}'
            )
        if response.get("uid") != uid:
            if hook.get("failurePolicy", "Fail") == "Ignore":
                return None
            return errors.ApiError(
                500,
                "InternalError",
                f'Internal error occurred: failed calling webhook "{name}": '
                f'expected response.uid="{uid}", got "{response.get("uid")}"',
            )
        if response.get("allowed") is True:
            return None
        found = response.get("status")
        status: dict[str, Any] = found if isinstance(found, dict) else {}
        given = status.get("code")
        code = given if isinstance(given, int) and given >= 400 else 400
        denied = f'admission webhook "{name}" denied the request'
        message = status.get("message") or status.get("reason") or ""
        text = f"{denied}: {message}" if message else f"{denied} without explanation"
        return errors.ApiError(code, str(status.get("reason") or ""), text, status.get("details"))

    async def _post(self, hook: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        client = hook.get("clientConfig") or {}
        url, server_name = self._target(client)
        timeout = int(hook.get("timeoutSeconds") or DEFAULT_TIMEOUT)
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with asyncio.timeout(timeout):
                async with self._session.post(
                    url,
                    data=msgspec.json.encode(body),
                    headers={"Content-Type": "application/json"},
                    ssl=self._context(client.get("caBundle", "")),
                    server_hostname=server_name,
                ) as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        raise _CallFailed(f"failed to call webhook: the server responded with status {resp.status}")
        except TimeoutError:
            raise _CallFailed(f'failed to call webhook: Post "{url}": context deadline exceeded') from None
        except (aiohttp.ClientError, OSError, ssl.SSLError) as exc:
            raise _CallFailed(f'failed to call webhook: Post "{url}": {exc}') from None
        try:
            review = _JSON.decode(raw)
            response = review["response"]
            assert isinstance(response, dict)
            return response
        except (msgspec.DecodeError, KeyError, TypeError, AssertionError):
            raise _CallFailed("received invalid webhook response: not an AdmissionReview with a response") from None

    def _target(self, client: dict[str, Any]) -> tuple[str, str | None]:
        """(URL to dial, name to verify the certificate against: None for the URL's own host)."""
        if client.get("url"):
            return str(client["url"]), None
        svc = client.get("service") or {}
        name, namespace = svc.get("name", ""), svc.get("namespace", "")
        dns = f"{name}.{namespace}.svc"
        host = dns
        service = self.store.get(("", "services"), (namespace, name))
        spec = (service or {}).get("spec") or {}
        if spec.get("type") == "ExternalName" and spec.get("externalName"):
            host = str(spec["externalName"])
        path = svc.get("path") or ""
        return f"https://{host}:{int(svc.get('port') or 443)}{path}", dns

    def _context(self, ca_bundle: str) -> ssl.SSLContext:
        found = self._contexts.get(ca_bundle)
        if found is None:
            if ca_bundle:
                try:
                    pem = base64.b64decode(ca_bundle).decode()
                    found = ssl.create_default_context(cadata=pem)
                except (ValueError, ssl.SSLError) as exc:
                    raise _CallFailed(f"failed to call webhook: unusable caBundle: {exc}") from None
            else:
                found = ssl.create_default_context()  # the system's trust store, as upstream without caBundle
            self._contexts[ca_bundle] = found
        return found

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def review_request(
    user: UserInfo,
    operation: str,
    res: Resource,
    version: str,
    subresource: str,
    namespace: str,
    subject: dict[str, Any],
    obj: dict[str, Any] | None,
    old: dict[str, Any] | None,
    dry_run: bool,
) -> dict[str, Any]:
    """The AdmissionReview `request` (without its uid) for a write."""
    gvk = {"group": res.group, "version": version, "kind": res.kind}
    gvr = {"group": res.group, "version": version, "resource": res.plural}
    return {
        "kind": gvk,
        "resource": gvr,
        "subResource": subresource,
        "requestKind": gvk,
        "requestResource": gvr,
        "name": (subject.get("metadata") or {}).get("name", ""),
        "namespace": namespace,
        "operation": operation,
        "userInfo": user.to_json(),
        "object": obj,
        "oldObject": old,
        "dryRun": dry_run,
        "options": None,
    }
