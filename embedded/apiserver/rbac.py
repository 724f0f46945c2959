"""Authorization: RBAC over the Roles, ClusterRoles and their bindings stored in this server.

Owns the request attributes as upstream's RequestInfoFactory derives them (verb from the method,
list/watch/deletecollection, resource/subresource, namespace, name, non-resource paths), rule
matching as upstream's RBAC authorizer does it (`*`, `*/subresource`, resourceNames,
nonResourceURLs with a trailing `*`), the `system:masters` bypass, the 403 Status with the real
server's message, and the bootstrap roles every cluster has (cluster-admin, system:discovery,
system:basic-user, system:public-info-viewer).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from embedded.apiserver import errors
from embedded.apiserver.authn import KUBELET_CLIENT, MASTERS, SA_PREFIX, UserInfo
from embedded.apiserver.storage import Change, Store

RBAC = "rbac.authorization.k8s.io"
_NAMESPACE_SUBRESOURCES = {"status", "finalize"}
_METHOD_VERBS = {"POST": "create", "GET": "get", "HEAD": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


@dataclass(frozen=True)
class Attributes:
    verb: str
    path: str
    resource_request: bool
    api_group: str = ""
    api_version: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""
    # (field, "=" or "!=", value) of a list, watch or deletecollection's fieldSelector, as upstream's
    # authorizer attributes carry them (the Node authorizer allows a node's scoped lists by them)
    field_selector: tuple[tuple[str, str, str], ...] = ()


def field_requirements(selector: str) -> tuple[tuple[str, str, str], ...]:
    """A fieldSelector's terms as (field, operator, value); `==` is `=`. Terms that are not a comparison are
    left out (the selector's own parser refuses them later)."""
    out = []
    for term in selector.split(","):
        key, op, value = term.partition("!=")
        if not op:
            key, op, value = term.replace("==", "=", 1).partition("=")
        if op and key.strip():
            out.append((key.strip(), op, value.strip()))
    return tuple(out)


_CONNECT_SUBRESOURCES = ("exec", "attach", "portforward")


@functools.lru_cache(maxsize=4096)
def request_attributes(method: str, path: str, query: str = "") -> Attributes:
    """What a request asks to do, the way upstream's RequestInfoFactory reads a URL (cached: a pure
    function of its arguments, and clients ask for the same objects again and again)."""
    verb = _METHOD_VERBS.get(method.upper(), method.lower())
    parts = [p for p in path.split("/") if p]
    if not parts or parts[0] not in ("api", "apis"):
        return Attributes(verb, path, False)
    prefix_len = 2 if parts[0] == "api" else 3
    if len(parts) < prefix_len + 1:  # /api, /api/v1, /apis/group/version: discovery, not a resource
        return Attributes(verb, path, False)
    group = "" if parts[0] == "api" else parts[1]
    version = parts[prefix_len - 1]
    rest = parts[prefix_len:]
    if rest[0] == "watch":  # the deprecated /watch/ prefix
        verb, rest = "watch", rest[1:]
        if not rest:
            return Attributes(verb, path, False)
    namespace = ""
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in _NAMESPACE_SUBRESOURCES:
            rest = rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    params = parse_qs(query)
    selector: tuple[tuple[str, str, str], ...] = ()
    if not name and verb in ("get", "delete"):
        selector = field_requirements((params.get("fieldSelector") or [""])[0])
    if not name and verb == "get":
        verb = "watch" if (params.get("watch") or [""])[0] in ("1", "t", "T", "true", "TRUE", "True") else "list"
        # A list or watch of one name (fieldSelector metadata.name=x) is authorized as that name.
        for key, op, value in selector:
            if key == "metadata.name" and op == "=" and value:
                name = value
    if not name and verb == "delete":
        verb = "deletecollection"
    if group == "" and resource == "pods" and subresource in _CONNECT_SUBRESOURCES:
        verb = "create"  # a WebSocket opens with GET; upstream 1.35 asks create (AuthorizePodWebsocketUpgrade...)
    return Attributes(verb, path, True, group, version, resource, subresource, namespace, name, selector)


def forbidden(user: UserInfo, attrs: Attributes, reason: str = "") -> errors.ApiError:
    """The real server's 403: `<resource>.<group> "<name>" is forbidden: User "<user>" cannot <verb> ...`."""
    if not attrs.resource_request:
        msg = f'User "{user.username}" cannot {attrs.verb} path "{attrs.path}"'
    else:
        resource = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
        where = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
        msg = (
            f'User "{user.username}" cannot {attrs.verb} resource "{resource}" in API group "{attrs.api_group}" {where}'
        )
    if reason:
        msg = f"{msg}: {reason}"
    if not attrs.resource_request:
        return errors.ApiError(403, "Forbidden", f"forbidden: {msg}", {})
    group_resource = f"{attrs.resource}.{attrs.api_group}" if attrs.api_group else attrs.resource
    named = f'{group_resource} "{attrs.name}"' if attrs.name else group_resource
    details: dict[str, Any] = {"group": attrs.api_group, "kind": attrs.resource}
    if attrs.name:
        details["name"] = attrs.name
    if not attrs.api_group:
        details.pop("group")
    return errors.ApiError(403, "Forbidden", f"{named} is forbidden: {msg}", details)


def _subject_matches(subject: dict[str, Any], user: UserInfo, binding_namespace: str) -> bool:
    kind = subject.get("kind")
    name = subject.get("name", "")
    if kind == "User":
        return bool(name == user.username)
    if kind == "Group":
        return name in user.groups
    if kind == "ServiceAccount":
        ns = subject.get("namespace") or binding_namespace
        return user.username == f"{SA_PREFIX}{ns}:{name}"
    return False


def _has(values: list[str] | None, wanted: str) -> bool:
    return bool(values) and ("*" in values or wanted in values)  # type: ignore[operator]


def rule_allows(rule: dict[str, Any], attrs: Attributes) -> bool:
    if not _has(rule.get("verbs"), attrs.verb):
        return False
    if not attrs.resource_request:
        for url in rule.get("nonResourceURLs") or []:
            if url == "*" or url == attrs.path or (url.endswith("*") and attrs.path.startswith(url[:-1])):
                return True
        return False
    if not _has(rule.get("apiGroups"), attrs.api_group):
        return False
    combined = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    resource_ok = False
    for allowed in rule.get("resources") or []:
        if allowed in ("*", combined) or (attrs.subresource and allowed == f"*/{attrs.subresource}"):
            resource_ok = True
            break
    if not resource_ok:
        return False
    names = rule.get("resourceNames") or []
    return not names or attrs.name in names


_DECISIONS = 8192  # decisions kept between RBAC changes; all are dropped when there are more


class RbacAuthorizer:
    """Evaluates each request against the stored RBAC objects. A decision depends only on the user's
    name and groups, the request's attributes and the RBAC objects, so it is kept until any Role,
    ClusterRole or binding changes (the store tells every change synchronously, before the write is
    answered: the next request sees the new rules)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._decisions: dict[tuple[str, tuple[str, ...], Attributes], tuple[bool, str]] = {}
        store.add_listener(self._changed)

    def _changed(self, change: Change) -> None:
        if change.res[0] == RBAC and self._decisions:
            self._decisions.clear()

    def authorize(self, user: UserInfo, attrs: Attributes) -> tuple[bool, str]:
        """(allowed, reason); the reason names roles that bindings refer to but that do not exist."""
        if MASTERS in user.groups:
            return True, ""
        key = (user.username, user.groups, attrs)
        try:
            decision = self._decisions.get(key)
        except TypeError:  # an access review's attributes that are not strings: decided, not kept
            return self._decide(user, attrs)
        if decision is None:
            decision = self._decide(user, attrs)
            if len(self._decisions) >= _DECISIONS:
                self._decisions.clear()
            self._decisions[key] = decision
        return decision

    def _decide(self, user: UserInfo, attrs: Attributes) -> tuple[bool, str]:
        missing: list[str] = []
        for _, binding in self.store.items((RBAC, "clusterrolebindings")):
            if self._binding_allows(binding, "", user, attrs, missing):
                return True, ""
        if attrs.namespace:
            for _, binding in self.store.items((RBAC, "rolebindings"), attrs.namespace):
                if self._binding_allows(binding, attrs.namespace, user, attrs, missing):
                    return True, ""
        reason = ""
        if missing:
            reason = "RBAC: " + ("[" + ", ".join(missing) + "]" if len(missing) > 1 else missing[0])
        return False, reason

    def rules_for(self, user: UserInfo, namespace: str) -> list[dict[str, Any]]:
        """Every rule that applies to `user` in `namespace` (SelfSubjectRulesReview, `kubectl auth can-i --list`)."""
        if MASTERS in user.groups:
            return [
                rule
                for role in bootstrap_cluster_roles()
                if role["metadata"]["name"] == "cluster-admin"
                for rule in role["rules"]
            ]
        bindings = [("", b) for _, b in self.store.items((RBAC, "clusterrolebindings"))]
        if namespace:
            bindings += [(namespace, b) for _, b in self.store.items((RBAC, "rolebindings"), namespace)]
        rules: list[dict[str, Any]] = []
        for ns, binding in bindings:
            if not any(_subject_matches(s, user, ns) for s in binding.get("subjects") or []):
                continue
            ref = binding.get("roleRef") or {}
            if ref.get("kind") == "ClusterRole":
                role = self.store.get((RBAC, "clusterroles"), ("", ref.get("name", "")))
            else:
                role = self.store.get((RBAC, "roles"), (ns, ref.get("name", "")))
            rules.extend((role or {}).get("rules") or [])
        return rules

    def _binding_allows(
        self, binding: dict[str, Any], namespace: str, user: UserInfo, attrs: Attributes, missing: list[str]
    ) -> bool:
        if not any(_subject_matches(s, user, namespace) for s in binding.get("subjects") or []):
            return False
        ref = binding.get("roleRef") or {}
        if ref.get("kind") == "ClusterRole":
            role = self.store.get((RBAC, "clusterroles"), ("", ref.get("name", "")))
            what = f'clusterrole.rbac.authorization.k8s.io "{ref.get("name", "")}" not found'
        else:
            role = self.store.get((RBAC, "roles"), (namespace, ref.get("name", "")))
            what = f'role.rbac.authorization.k8s.io "{ref.get("name", "")}" not found'
        if role is None:
            missing.append(what)
            return False
        return any(rule_allows(rule, attrs) for rule in role.get("rules") or [])


_BOOTSTRAP_LABELS = {"kubernetes.io/bootstrapping": "rbac-defaults"}
_DISCOVERY_URLS = [
    "/api",
    "/api/*",
    "/apis",
    "/apis/*",
    "/healthz",
    "/livez",
    "/openapi",
    "/openapi/*",
    "/readyz",
    "/version",
    "/version/",
]


def bootstrap_cluster_roles() -> list[dict[str, Any]]:
    """The default ClusterRoles of every cluster that the local one relies on."""

    def role(name: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "apiVersion": f"{RBAC}/v1",
            "kind": "ClusterRole",
            "metadata": {"name": name, "labels": dict(_BOOTSTRAP_LABELS)},
            "rules": rules,
        }

    return [
        role(
            "cluster-admin",
            [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}, {"nonResourceURLs": ["*"], "verbs": ["*"]}],
        ),
        role("system:discovery", [{"nonResourceURLs": _DISCOVERY_URLS, "verbs": ["get"]}]),
        role(
            "system:basic-user",
            [
                {
                    "apiGroups": ["authorization.k8s.io"],
                    "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
                    "verbs": ["create"],
                },
                {"apiGroups": ["authentication.k8s.io"], "resources": ["selfsubjectreviews"], "verbs": ["create"]},
            ],
        ),
        role(
            "system:kubelet-api-admin",
            [
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "proxy"]},
                {
                    "apiGroups": [""],
                    "resources": ["nodes/log", "nodes/metrics", "nodes/proxy", "nodes/stats"],
                    "verbs": ["*"],
                },
            ],
        ),
        role(
            "system:public-info-viewer",
            [{"nonResourceURLs": ["/healthz", "/livez", "/readyz", "/version", "/version/"], "verbs": ["get"]}],
        ),
    ]


def bootstrap_cluster_role_bindings() -> list[dict[str, Any]]:
    def binding(name: str, role: str, groups: list[str]) -> dict[str, Any]:
        return {
            "apiVersion": f"{RBAC}/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name, "labels": dict(_BOOTSTRAP_LABELS)},
            "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": RBAC, "kind": "Group", "name": g} for g in groups],
        }

    return [
        binding("cluster-admin", "cluster-admin", [MASTERS]),
        binding("system:discovery", "system:discovery", ["system:authenticated"]),
        binding("system:basic-user", "system:basic-user", ["system:authenticated"]),
        {
            **binding("system:kube-apiserver-kubelet-client", "system:kubelet-api-admin", []),
            "subjects": [{"apiGroup": RBAC, "kind": "User", "name": KUBELET_CLIENT}],
        },
        binding(
            "system:public-info-viewer", "system:public-info-viewer", ["system:authenticated", "system:unauthenticated"]
        ),
    ]
