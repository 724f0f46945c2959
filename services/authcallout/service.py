"""The NATS auth callout: who a connecting node service is, from its ServiceAccount token.

nats-server hands every connect of the `AUTH` account's sentinel user to this service
(`$SYS.REQ.USER.AUTH`, shared.natsjwt has the protocol facts). The client sent its projected
ServiceAccount token (audience `nats`) as the auth token and the identity it asks for
(`<role>.<node>`) as its connection name. The service asks Kubernetes who holds the token (a
TokenReview through the one kube client), takes the node from the token's bound pod
(`authentication.kubernetes.io/node-name` in user.extra, Kubernetes 1.30+) and the roles from the
ServiceAccount, and answers with a user JWT in `GPU_DRA` carrying that role's permissions for that
node (shared.natsusers), expiring no later than the token. Anything else is refused with a reason
that is logged and counted (`gpu_dra_nats_auth_callout_total{result,reason}`); the client sees
"authorization violation".
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from shared import natsjwt
from shared.events.catalog import NODE_ROLES
from shared.logs import get_logger
from shared.natsusers import UsersError, node_permissions, node_user
from shared.nkeys import KeyPair

log = get_logger(__name__)
NODE_NAME = "authentication.kubernetes.io/node-name"
POD_NAME = "authentication.kubernetes.io/pod-name"
SA_PREFIX = "system:serviceaccount:"
REQUEST_AUDIENCE = "nats-authorization-request"

DECISIONS = Counter("gpu_dra_nats_auth_callout", "NATS auth callout decisions", ["result", "reason"])


class Refused(Exception):
    """A connect that gets no user; `reason` is the metric label, the message says what to fix."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Review:
    """What a TokenReview said: who, with which extras, for which audiences, or why not."""

    authenticated: bool
    username: str = ""
    extra: Mapping[str, list[str]] | None = None
    audiences: tuple[str, ...] = ()
    error: str = ""


TokenReviewer = Callable[[str, str], Awaitable[Review]]


def parse_roles(text: str) -> dict[str, tuple[str, ...]]:
    """`ns/sa=role[,role];...` -> {"system:serviceaccount:ns:sa": roles}; roles are node roles."""
    out: dict[str, tuple[str, ...]] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        account, sep, roles = item.partition("=")
        namespace, slash, name = account.strip().partition("/")
        wanted = tuple(r.strip() for r in roles.split(",") if r.strip())
        if not sep or not slash or not namespace or not name or not wanted:
            raise UsersError(f"service account roles {item!r}: expected NAMESPACE/SERVICEACCOUNT=role[,role]")
        unknown = sorted(set(wanted) - set(NODE_ROLES))
        if unknown:
            raise UsersError(
                f"service account roles {item!r}: unknown role(s) {', '.join(unknown)}; known: {', '.join(NODE_ROLES)}"
            )
        out[f"{SA_PREFIX}{namespace}:{name}"] = wanted
    if not out:
        raise UsersError("no service account is given any role; e.g. gpu-dra/gpu-dra-node=discovery,preparer,cd-agent")
    return out


def _token_expiry(token: str) -> int | None:
    """The `exp` of a JWT the TokenReview has just accepted (read, not verified: Kubernetes did that)."""
    try:
        body = token.split(".")[1]
        value = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        return int(value["exp"])
    except (IndexError, ValueError, KeyError, TypeError):
        return None


class AuthCallout:
    """Decides one authorization request at a time (the NATS loop is in cli.py)."""

    def __init__(
        self,
        *,
        issuer: KeyPair,
        account: str,
        auth_account: str,
        roles: Mapping[str, tuple[str, ...]],
        review: TokenReviewer,
        audience: str = "nats",
        max_ttl_s: int = 3600,
    ) -> None:
        self.issuer = issuer
        self.account = account
        self.auth_account = auth_account
        self.roles = dict(roles)
        self.review = review
        self.audience = audience
        self.max_ttl_s = max_ttl_s

    async def answer(self, request_jwt: bytes) -> bytes:
        """The authorization-response JWT for one request (a user JWT, or a refusal)."""
        try:
            claims = natsjwt.decode_claims(request_jwt.decode(errors="replace"))
        except natsjwt.CredsError as exc:
            DECISIONS.labels("refused", "bad-request").inc()
            log.warning("nats auth callout: not an authorization request", error=str(exc))
            return b""  # nothing to answer: the server times the connect out
        nats = claims.get("nats") or {}
        user_nkey = str(nats.get("user_nkey") or "")
        server_id = str((nats.get("server_id") or {}).get("id") or "")
        if (
            nats.get("type") != "authorization_request"
            or claims.get("aud") != REQUEST_AUDIENCE
            or not user_nkey
            or not server_id
        ):
            DECISIONS.labels("refused", "bad-request").inc()
            log.warning("nats auth callout: not an authorization request", type=nats.get("type"))
            return b""
        opts = nats.get("connect_opts") or {}
        client = {"host": (nats.get("client_info") or {}).get("host", ""), "asked": opts.get("name", "")}
        try:
            identity, node, permissions, expires = await self._decide(
                str(opts.get("auth_token") or ""), str(opts.get("name") or "")
            )
        except Refused as exc:
            DECISIONS.labels("refused", exc.reason).inc()
            log.warning("nats connect refused", reason=exc.reason, error=str(exc), **client)
            return (
                await asyncio.to_thread(
                    natsjwt.authorization_response, self.issuer, self.auth_account, user_nkey, server_id, error=str(exc)
                )
            ).encode()
        user = await asyncio.to_thread(
            natsjwt.user_jwt,
            self.issuer,
            user_nkey,
            identity,
            publish=sorted(set(permissions.publish)),
            subscribe=sorted(set(permissions.subscribe)),
            allow_responses=permissions.allow_responses,
            issuer_account=self.account,
            expires=expires,
        )
        response = await asyncio.to_thread(
            natsjwt.authorization_response, self.issuer, self.auth_account, user_nkey, server_id, user_jwt=user
        )
        DECISIONS.labels("allowed", "ok").inc()
        log.info("nats connect authorized", identity=identity, node=node, expires=expires, **client)
        return response.encode()

    async def _decide(self, token: str, asked: str) -> tuple[str, str, Any, int]:
        if not token:
            raise Refused(
                "no-token",
                "no ServiceAccount token was sent; set GPU_DRA_NATS_TOKEN_FILE to a projected "
                f"token with audience {self.audience}",
            )
        try:
            review = await self.review(token, self.audience)
        except Exception as exc:  # noqa: BLE001 - any failure to ask Kubernetes refuses, with its cause
            raise Refused(
                "review-failed",
                f"the TokenReview failed ({exc}); check the callout's RBAC (create tokenreviews) and the API server",
            ) from exc
        if not review.authenticated:
            reason = "audience" if "audience" in review.error else "unauthenticated"
            raise Refused(
                reason, f"the token was not accepted for audience {self.audience}: {review.error or 'no reason given'}"
            )
        if self.audience not in review.audiences:
            raise Refused("audience", f"the token is not for audience {self.audience}")
        extra = review.extra or {}
        node = (extra.get(NODE_NAME) or [""])[0]
        if not node or not (extra.get(POD_NAME) or [""])[0]:
            raise Refused(
                "not-node-bound",
                f"the token of {review.username} is not bound to a pod on a node; "
                "use a projected ServiceAccount token (serviceAccountToken volume)",
            )
        roles = self.roles.get(review.username)
        if not roles:
            raise Refused(
                "unknown-service-account",
                f"{review.username} has no NATS role; add it to --service-account-roles if it should have one",
            )
        role, _, asked_node = asked.partition(".")
        if len(roles) == 1 and not asked:
            role, asked_node = roles[0], node
        if role not in roles or asked_node != node:
            raise Refused(
                "identity-not-allowed",
                f"{review.username} on node {node} asked to be {asked!r}; it may "
                f"be {', '.join(node_user(r, node) for r in roles)}",
            )
        try:
            permissions = node_permissions(role, node)
        except UsersError as exc:
            raise Refused("bad-node", str(exc)) from None
        limit = int(time.time()) + self.max_ttl_s
        token_exp = _token_expiry(token)
        return node_user(role, node), node, permissions, min(limit, token_exp or limit)


def kube_token_reviewer(api: Any) -> TokenReviewer:
    """A TokenReviewer that asks the API server (`create tokenreviews`) through kubernetes-asyncio."""
    from kubernetes_asyncio import client

    async def review(token: str, audience: str) -> Review:
        body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=[audience]))
        out = await client.AuthenticationV1Api(api).create_token_review(body)
        status = out.status
        user = status.user if status is not None else None
        return Review(
            bool(status and status.authenticated),
            username=(user.username if user else "") or "",
            extra=(user.extra if user else None) or {},
            audiences=tuple(status.audiences or ()),
            error=status.error or "",
        )

    return review
