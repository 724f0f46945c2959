"""The API server's APIs that store nothing: SelfSubjectAccessReview and SelfSubjectRulesReview
(`kubectl auth can-i [--list]`, answered by the same authorizers as the caller's requests: Node, RBAC),
SubjectAccessReview (the same question for a user a service names), TokenRequest
(`kubectl create token`, or the kubelet's projected tokens: a ServiceAccount token from the
authenticator, bound to a pod when `boundObjectRef` names one) and TokenReview (a service asks who a
token's holder is, for the audiences it accepts). Each takes the decoded request body and returns
the response object."""

from __future__ import annotations

import datetime as dt
from typing import Any

from embedded.apiserver import errors
from embedded.apiserver.authn import ISSUER, Authenticator, UserInfo
from embedded.apiserver.authz import Authorizer, Chain
from embedded.apiserver.rbac import Attributes, field_requirements


def _spec(body: Any) -> dict[str, Any]:
    spec = body.get("spec") if isinstance(body, dict) else None
    return dict(spec) if isinstance(spec, dict) else {}


def access_review(authorizer: Authorizer, user: UserInfo, body: Any) -> dict[str, Any]:
    """May `user` do what the review's spec describes?"""
    spec = _spec(body)
    ra: dict[str, Any] = spec.get("resourceAttributes") or {}
    nra: dict[str, Any] = spec.get("nonResourceAttributes") or {}
    if bool(ra) == bool(nra):
        raise errors.ApiError(
            422,
            "Invalid",
            'SelfSubjectAccessReview.authorization.k8s.io "" is invalid: '
            "spec: Invalid value: exactly one of nonResourceAttributes or "
            "resourceAttributes must be specified",
        )
    if ra:
        field_selector = ra.get("fieldSelector")
        selector = field_selector.get("rawSelector") if isinstance(field_selector, dict) else None
        attrs = Attributes(
            ra.get("verb", ""),
            "",
            True,
            ra.get("group", ""),
            ra.get("version", ""),
            ra.get("resource", ""),
            ra.get("subresource", ""),
            ra.get("namespace", ""),
            ra.get("name", ""),
            field_requirements(selector) if isinstance(selector, str) else (),
        )
    else:
        attrs = Attributes(nra.get("verb", ""), nra.get("path", ""), False)
    allowed, reason = authorizer.authorize(user, attrs)
    status: dict[str, Any] = {"allowed": allowed}
    if reason:
        status["reason"] = reason
    return {
        "kind": "SelfSubjectAccessReview",
        "apiVersion": "authorization.k8s.io/v1",
        "metadata": {"creationTimestamp": None},
        "spec": spec,
        "status": status,
    }


def subject_access_review(authorizer: Authorizer, body: Any) -> dict[str, Any]:
    """May the user the spec names (user, groups, uid, extra) do what it describes? (a service asks for a
    caller it has authenticated, e.g. the dashboard for a viewer's token)."""
    spec = _spec(body)
    if not spec.get("user") and not spec.get("groups"):
        raise errors.ApiError(
            422,
            "Invalid",
            'SubjectAccessReview.authorization.k8s.io "" is invalid: spec.user: '
            "Invalid value: at least one of user or group must be specified",
        )
    user = UserInfo(
        str(spec.get("user") or ""),
        str(spec.get("uid") or ""),
        tuple(str(g) for g in spec.get("groups") or ()),
        dict(spec.get("extra") or {}),
    )
    review = access_review(authorizer, user, body)
    review["kind"] = "SubjectAccessReview"
    return review


def rules_review(authorizer: Chain, user: UserInfo, body: Any) -> dict[str, Any]:
    """Every rule that applies to `user` in the spec's namespace (incomplete for a node, as upstream)."""
    spec = _spec(body)
    resource_rules, non_resource_rules = [], []
    rules, incomplete = authorizer.rules_for(user, str(spec.get("namespace") or ""))
    for rule in rules:
        if rule.get("nonResourceURLs"):
            non_resource_rules.append({"verbs": rule.get("verbs") or [], "nonResourceURLs": rule["nonResourceURLs"]})
        else:
            resource_rules.append(
                {k: rule[k] for k in ("verbs", "apiGroups", "resources", "resourceNames") if rule.get(k) is not None}
            )
    status: dict[str, Any] = {
        "resourceRules": resource_rules,
        "nonResourceRules": non_resource_rules,
        "incomplete": bool(incomplete),
    }
    if incomplete:
        status["evaluationError"] = incomplete
    return {
        "kind": "SelfSubjectRulesReview",
        "apiVersion": "authorization.k8s.io/v1",
        "metadata": {"creationTimestamp": None},
        "spec": spec,
        "status": status,
    }


def token_request(authenticator: Authenticator, service_account: dict[str, Any], body: Any) -> dict[str, Any]:
    """A token for the stored `service_account` (10 minutes at least, an hour by default)."""
    md = service_account.get("metadata") or {}
    name, namespace = md.get("name", ""), md.get("namespace", "")
    spec = _spec(body)
    seconds = spec.get("expirationSeconds") or 3600
    if not isinstance(seconds, int) or seconds < 600:
        raise errors.ApiError(
            422,
            "Invalid",
            f'TokenRequest.authentication.k8s.io "{name}" is invalid: '
            "spec.expirationSeconds: Invalid value: may not specify a duration less "
            "than 10 minutes",
        )
    audiences = list(spec.get("audiences") or [ISSUER])
    bound = _bound_pod(authenticator, name, namespace, spec.get("boundObjectRef"))
    token, expires = authenticator.issue(namespace, name, md.get("uid", ""), seconds, audiences, bound)
    spec.update(audiences=audiences, expirationSeconds=seconds, boundObjectRef=spec.get("boundObjectRef"))
    stamp = dt.datetime.fromtimestamp(expires, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "kind": "TokenRequest",
        "apiVersion": "authentication.k8s.io/v1",
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": None},
        "spec": spec,
        "status": {"token": token, "expirationTimestamp": stamp},
    }


def _bound_pod(authenticator: Authenticator, name: str, namespace: str, ref: Any) -> dict[str, Any] | None:
    """The `pod` (and, once scheduled, `node`) claims of a token bound to a pod of the SA's namespace."""
    if not ref:
        return None
    invalid = f'TokenRequest.authentication.k8s.io "{name}" is invalid: spec.boundObjectRef'
    if not isinstance(ref, dict) or ref.get("kind") != "Pod" or ref.get("apiVersion", "v1") != "v1":
        raise errors.ApiError(
            422,
            "Invalid",
            f"{invalid}.kind: Unsupported value: {ref!r}: this API server binds tokens to Pods (v1) only",
        )
    pod = authenticator.store.get(("", "pods"), (namespace, str(ref.get("name") or "")))
    if pod is None:
        raise errors.ApiError(404, "NotFound", f'pods "{ref.get("name")}" not found')
    uid = (pod.get("metadata") or {}).get("uid", "")
    if ref.get("uid") and ref["uid"] != uid:
        raise errors.ApiError(
            409,
            "Conflict",
            f"the UID in the bound object reference ({ref['uid']}) does not "
            f"match the UID in record ({uid}). The object might have been deleted and then "
            "recreated",
        )
    out: dict[str, Any] = {"pod": {"name": pod["metadata"]["name"], "uid": uid}}
    node_name = (pod.get("spec") or {}).get("nodeName") or ""
    if node_name:
        node = authenticator.store.get(("", "nodes"), ("", node_name))
        out["node"] = {"name": node_name, "uid": ((node or {}).get("metadata") or {}).get("uid", "")}
    return out


def token_review(authenticator: Authenticator, body: Any) -> dict[str, Any]:
    """Who holds `spec.token`, for one of `spec.audiences` (the API server's own when none are given)."""
    spec = _spec(body)
    token = spec.get("token")
    if not isinstance(token, str) or not token:
        raise errors.ApiError(
            422,
            "Invalid",
            'TokenReview.authentication.k8s.io "" is invalid: spec.token: Required value: token must be set',
        )
    wanted = [str(a) for a in spec.get("audiences") or [ISSUER]]
    user, accepted, error = authenticator.review(token, wanted)
    status: dict[str, Any] = {"authenticated": user is not None, "user": {}}
    if user is not None:
        status.update(user=user.to_json(), audiences=accepted)
    else:
        status["error"] = error or "invalid bearer token"
    return {
        "kind": "TokenReview",
        "apiVersion": "authentication.k8s.io/v1",
        "metadata": {"creationTimestamp": None},
        "spec": spec,
        "status": status,
    }


def self_subject_review(user: UserInfo) -> dict[str, Any]:
    """Who the caller is, as authenticated (`kubectl auth whoami`): a SelfSubjectReview's status."""
    return {
        "kind": "SelfSubjectReview",
        "apiVersion": "authentication.k8s.io/v1",
        "metadata": {"creationTimestamp": None},
        "status": {"userInfo": user.to_json()},
    }
