"""Impersonation: a request's `Impersonate-*` headers (`kubectl --as`, `--as-group`, `--as-uid`, client-go's
`rest.Config.Impersonate`) make it act as another user, once the caller may `impersonate` each thing it names.

As upstream's filter decides it (k8s.io/apiserver endpoints/filters, WithImpersonation):
- `Impersonate-User`: a `system:serviceaccount:<namespace>:<name>` name is the ServiceAccount (resource
  `serviceaccounts` in that namespace; its groups `system:serviceaccounts` and `system:serviceaccounts:<namespace>`
  unless groups are named); any other name is resource `users`;
- each `Impersonate-Group`: resource `groups`; `Impersonate-Uid`: resource `uids` in `authentication.k8s.io`;
  each value of each `Impersonate-Extra-<key>`: resource `userextras`, subresource `<key>` (lower case,
  %-decoded), in `authentication.k8s.io`;
- groups, a uid or extras without a user: refused (500, as upstream's filter answers it);
- each is authorized for the caller with verb `impersonate`; the first refusal is the caller's 403;
- the user acting is in `system:authenticated` unless a group named says `system:authenticated` or
  `system:unauthenticated` already (`system:anonymous`: `system:unauthenticated`).
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import unquote

from multidict import CIMultiDictProxy

from embedded.apiserver import authz, errors, rbac
from embedded.apiserver.authn import AUTHENTICATED, SA_PREFIX, SERVICE_ACCOUNTS, UserInfo

USER = "Impersonate-User"
GROUP = "Impersonate-Group"
UID = "Impersonate-Uid"
EXTRA = "impersonate-extra-"  # the prefix of `Impersonate-Extra-<key>`, compared lower case
ANONYMOUS = "system:anonymous"
UNAUTHENTICATED = "system:unauthenticated"
AUTHENTICATION_GROUP = "authentication.k8s.io"


def asks(headers: Mapping[str, str]) -> bool:
    """Whether a request names anyone to act as."""
    return any(key.lower().startswith("impersonate-") for key in headers)


def acting_user(authorizer: authz.Authorizer, caller: UserInfo, headers: CIMultiDictProxy[str]) -> UserInfo:
    """The user the request acts as (module doc); an ApiError (500 or the caller's 403) where it may not."""
    name = headers.get(USER, "")
    named_groups = headers.getall(GROUP, [])
    uid = headers.get(UID, "")
    extra: dict[str, list[str]] = {}
    for key, value in headers.items():
        if key.lower().startswith(EXTRA):
            extra.setdefault(unquote(key[len(EXTRA) :].lower()), []).append(value)
    if not name:
        asked = (
            [f"group {g!r}" for g in named_groups]
            + [f"uid {uid!r}"] * bool(uid)
            + [f"extra {k}={v!r}" for k, values in extra.items() for v in values]
        )
        raise errors.ApiError(
            500,
            "InternalError",
            f"Internal error occurred: requested [{', '.join(asked)}] without impersonating a user",
        )
    checks: list[rbac.Attributes] = []
    groups: list[str] = []
    account = _service_account(name)
    if account is not None:
        namespace, account_name = account
        checks.append(_impersonate("serviceaccounts", account_name, namespace=namespace))
        if not named_groups:
            groups = [SERVICE_ACCOUNTS, f"{SERVICE_ACCOUNTS}:{namespace}"]
    else:
        checks.append(_impersonate("users", name))
    for group in named_groups:
        checks.append(_impersonate("groups", group))
        groups.append(group)
    for key, values in extra.items():
        checks.extend(_impersonate("userextras", v, group=AUTHENTICATION_GROUP, subresource=key) for v in values)
    if uid:
        checks.append(_impersonate("uids", uid, group=AUTHENTICATION_GROUP))
    for attrs in checks:
        allowed, reason = authorizer.authorize(caller, attrs)
        if not allowed:
            raise rbac.forbidden(caller, attrs, reason)
    if name != ANONYMOUS:
        if AUTHENTICATED not in groups and UNAUTHENTICATED not in groups:
            groups.append(AUTHENTICATED)
    elif UNAUTHENTICATED not in groups:
        groups.append(UNAUTHENTICATED)
    return UserInfo(name, uid, tuple(groups), extra)


def _service_account(name: str) -> tuple[str, str] | None:
    """(namespace, name) of a ServiceAccount's user name, as upstream splits it; None for any other name."""
    if not name.startswith(SA_PREFIX):
        return None
    parts = name[len(SA_PREFIX) :].split(":")
    if len(parts) != 2 or not all(parts):
        return None
    return parts[0], parts[1]


def _impersonate(
    resource: str, name: str, *, namespace: str = "", group: str = "", subresource: str = ""
) -> rbac.Attributes:
    return rbac.Attributes(
        "impersonate",
        "",
        True,
        api_group=group,
        api_version="v1",
        resource=resource,
        subresource=subresource,
        namespace=namespace,
        name=name,
    )
