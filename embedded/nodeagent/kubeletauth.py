"""The kubelet API's authentication and authorization, delegated to the API server as a kubelet's webhook modes do.

Owns turning a request's bearer token into a user (TokenReview) and asking whether that user may do what the
request asks of this node (SubjectAccessReview on `nodes/<subresource>`, the kubelet's attributes: GET -> get,
POST -> create; `/exec`, `/attach`, `/portForward` are `nodes/proxy`). Answers are cached for a short while, as
the kubelet's `--authentication-token-webhook-cache-ttl` and authorization cache do.
"""

from __future__ import annotations

import time
from typing import Any

from shared.kube.rest import ApiError, decode, request

CACHE_SECONDS = 60.0
_VERBS = {"GET": "get", "HEAD": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


class KubeletAuth:
    def __init__(self, api: Any, node: str) -> None:
        self.api = api
        self.node = node
        self._users: dict[str, tuple[float, dict[str, Any] | None]] = {}
        self._decisions: dict[tuple[str, str, str], tuple[float, bool]] = {}

    async def user(self, authorization: str) -> dict[str, Any] | None:
        """The user a `Bearer` header names, or None (no token, or the API server does not know it)."""
        if not authorization.startswith("Bearer "):
            return None
        token = authorization[7:].strip()
        hit = self._users.get(token)
        if hit and hit[0] > time.monotonic():
            return hit[1]
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}
        status = (
            decode(await request(self.api, "POST", "/apis/authentication.k8s.io/v1/tokenreviews", body=review)).get(
                "status"
            )
            or {}
        )
        found = status.get("user") if status.get("authenticated") else None
        self._users[token] = (time.monotonic() + CACHE_SECONDS, found)
        return found

    async def allowed(self, user: dict[str, Any], method: str, subresource: str) -> bool:
        verb = _VERBS.get(method.upper(), method.lower())
        key = (user.get("username", ""), verb, subresource)
        hit = self._decisions.get(key)
        if hit and hit[0] > time.monotonic():
            return hit[1]
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": user.get("username", ""),
                "uid": user.get("uid", ""),
                "groups": user.get("groups") or [],
                "extra": user.get("extra") or {},
                "resourceAttributes": {
                    "verb": verb,
                    "resource": "nodes",
                    "subresource": subresource,
                    "name": self.node,
                },
            },
        }
        try:
            status = (
                decode(
                    await request(self.api, "POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", body=review)
                ).get("status")
                or {}
            )
        except ApiError:
            return False
        allowed = bool(status.get("allowed"))
        self._decisions[key] = (time.monotonic() + CACHE_SECONDS, allowed)
        return allowed
