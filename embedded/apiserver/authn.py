"""Authentication: a bearer token in, a user (name, uid, groups) out, or nobody (401).

Owns the two kinds of token a real API server accepts that the local cluster needs: static tokens
from a `--token-auth-file` CSV (`token,user,uid,"group1,group2"`, as kube-apiserver reads it) and
ServiceAccount tokens, JWTs this server signs when asked through the TokenRequest API
(`POST .../serviceaccounts/<name>/token`) and accepts while unexpired, for one of the audiences the
caller accepts (the API server's own, ISSUER, for requests; a TokenReview names others), and while
the ServiceAccount (and the pod a token is bound to) still exists with the uid the token names. A
token bound to a pod carries the pod and, when the pod is on a node, the node (as Kubernetes 1.30+
does), and authenticates with upstream's extras (`authentication.kubernetes.io/pod-name`,
`pod-uid`, `node-name`, `node-uid`, `credential-id`). The user of the request in flight is kept in
a context variable so that admission sees who is asking.
"""

from __future__ import annotations

import base64
import contextvars
import csv
import hashlib
import hmac
import io
import secrets
import time
from pathlib import Path
from typing import Any

import msgspec

from embedded.apiserver.storage import Store

AUTHENTICATED = "system:authenticated"
MASTERS = "system:masters"  # the group that bypasses authorization, as upstream
SERVICE_ACCOUNTS = "system:serviceaccounts"
ISSUER = "https://kubernetes.default.svc.cluster.local"
SA_PREFIX = "system:serviceaccount:"
NODE_PREFIX = "system:node:"  # a kubelet's user name is system:node:<node>, in group NODES
NODES = "system:nodes"
KUBELET_CLIENT = "kube-apiserver-kubelet-client"  # the API server's user towards kubelets (kubeadm's name)
EXTRA = "authentication.kubernetes.io/"  # upstream's prefix of a bound token's user.extra keys


class UserInfo(msgspec.Struct, frozen=True):
    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: dict[str, list[str]] = {}

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"username": self.username, "groups": list(self.groups)}
        if self.uid:
            body["uid"] = self.uid
        if self.extra:
            body["extra"] = self.extra
        return body


# Who the request in flight is; None for the server's own writes (GC, finalizers).
current_user: contextvars.ContextVar[UserInfo | None] = contextvars.ContextVar("current_user", default=None)


class TokenFileError(ValueError):
    """A token file line that is not `token,user,uid[,"groups"]`; the message names the line."""


def parse_token_file(text: str, source: str = "token file") -> dict[str, UserInfo]:
    """kube-apiserver's static token CSV: token,user,uid and an optional quoted comma-separated group list.
    Every user is also in system:authenticated, as upstream adds it."""
    users: dict[str, UserInfo] = {}
    for lineno, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        if not row or (len(row) == 1 and not row[0].strip()) or row[0].lstrip().startswith("#"):
            continue
        if len(row) < 3 or not row[0].strip() or not row[1].strip():
            raise TokenFileError(
                f'{source} line {lineno}: expected token,user,uid[,"group1,group2"], got {len(row)} field(s)'
            )
        token, user, uid = (c.strip() for c in row[:3])
        groups = [g.strip() for g in row[3].split(",") if g.strip()] if len(row) > 3 else []
        if token in users:
            raise TokenFileError(
                f"{source} line {lineno}: the token of {user!r} is already used by "
                f"{users[token].username!r}; every identity needs its own token"
            )
        users[token] = UserInfo(user, uid, tuple(dict.fromkeys([*groups, AUTHENTICATED])))
    return users


def node_identity(user: UserInfo) -> tuple[str, bool]:
    """(node name, whether `user` is a node), as upstream's default NodeIdentifier decides: a user named
    `system:node:<name>` in group `system:nodes`; the name may be empty (a node that names no node)."""
    if not user.username.startswith(NODE_PREFIX) or NODES not in user.groups:
        return "", False
    return user.username[len(NODE_PREFIX) :], True


def service_account_user(namespace: str, name: str, uid: str = "") -> UserInfo:
    return UserInfo(
        f"{SA_PREFIX}{namespace}:{name}", uid, (SERVICE_ACCOUNTS, f"{SERVICE_ACCOUNTS}:{namespace}", AUTHENTICATED)
    )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Authenticator:
    """Static tokens plus ServiceAccount JWTs signed with `signing_key` (HS256)."""

    def __init__(self, store: Store, static: dict[str, UserInfo], signing_key: bytes) -> None:
        self.store = store
        self.static = static
        self.signing_key = signing_key
        self._verified: dict[str, _Verified] = {}  # token -> its checked signature and claims

    @staticmethod
    def signing_key_for(data_dir: Path | None) -> bytes:
        """A key kept in the data dir (tokens survive a restart), or a fresh one in memory."""
        if data_dir is None:
            return secrets.token_bytes(32)
        path = data_dir / "sa-signing.key"
        if path.exists():
            return bytes.fromhex(path.read_text().strip())
        data_dir.mkdir(parents=True, exist_ok=True)
        key = secrets.token_bytes(32)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(key.hex())
        tmp.chmod(0o600)
        tmp.replace(path)
        return key

    @property
    def enabled(self) -> bool:
        return bool(self.static)

    def _static_user(self, token: str) -> UserInfo | None:
        for known, user in self.static.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                return user
        return None

    def authenticate(self, token: str) -> UserInfo | None:
        """The user of an API request's bearer token (ServiceAccount tokens for the API server's audience)."""
        user = self._static_user(token)
        if user is not None:
            return user
        if token.count(".") == 2:
            return self.review(token, [ISSUER])[0]
        return None

    def review(self, token: str, audiences: list[str]) -> tuple[UserInfo | None, list[str], str]:
        """A token checked for one of `audiences`: its user, the audiences it was accepted for, and why it was
        not (empty when it was), as a TokenReview reports them. A static token knows no audience: it is good
        for the API server's own, as upstream's token file authenticator is."""
        user = self._static_user(token)
        if user is not None:
            return (user, [ISSUER], "") if ISSUER in audiences else (None, [], "token audiences are invalid")
        if token.count(".") != 2:
            return None, [], "invalid bearer token"
        return self._service_account(token, audiences)

    def issue(
        self,
        namespace: str,
        name: str,
        uid: str,
        expiration_seconds: int,
        audiences: list[str],
        bound: dict[str, Any] | None = None,
    ) -> tuple[str, int]:
        """A ServiceAccount token and its expiry (Unix seconds); `bound` adds the `pod` and `node`
        ({"name", "uid"}) the token is bound to."""
        issued = int(time.time())
        expires = issued + expiration_seconds
        k8s: dict[str, Any] = {"namespace": namespace, "serviceaccount": {"name": name, "uid": uid}, **(bound or {})}
        claims = {
            "aud": audiences or [ISSUER],
            "exp": expires,
            "iat": issued,
            "nbf": issued,
            "iss": ISSUER,
            "sub": f"{SA_PREFIX}{namespace}:{name}",
            "jti": secrets.token_hex(8),
            "kubernetes.io": k8s,
        }
        head = _b64(msgspec.json.encode({"alg": "HS256", "typ": "JWT"}))
        body = _b64(msgspec.json.encode(claims))
        sig = _b64(hmac.new(self.signing_key, f"{head}.{body}".encode(), hashlib.sha256).digest())
        return f"{head}.{body}.{sig}", expires

    def _service_account(self, token: str, audiences: list[str]) -> tuple[UserInfo | None, list[str], str]:
        invalid = "invalid bearer token"
        verified = self._verified.get(token)
        if verified is None:
            verified = self._verify(token)
            if verified is None:
                return None, [], invalid
            if len(self._verified) >= _VERIFIED_TOKENS:
                self._verified.clear()  # a bound, not an LRU: tokens are few and live long
            self._verified[token] = verified
        if verified.expires <= time.time():
            return None, [], f"{invalid}, service account token has expired"
        accepted = [a for a in audiences if a in verified.audiences]
        if not accepted:
            return (
                None,
                [],
                (
                    f"{invalid}, token audiences {list(verified.audiences)} is invalid for the target "
                    f"audiences {audiences}"
                ),
            )
        namespace, sa_name = verified.namespace, verified.sa_name
        stored = self.store.get(("", "serviceaccounts"), (namespace, sa_name))
        if stored is None or (stored.get("metadata") or {}).get("uid") != verified.sa_uid:
            # the ServiceAccount was deleted (or recreated): its tokens die with it
            return None, [], f"{invalid}, service account {namespace}/{sa_name} has been deleted"
        if verified.pod is not None:
            pod_name, pod_uid = verified.pod
            stored_pod = self.store.get(("", "pods"), (namespace, pod_name))
            if stored_pod is None or (stored_pod.get("metadata") or {}).get("uid") != pod_uid:
                return None, [], f"{invalid}, pod {namespace}/{pod_name} the token is bound to is gone"
        return verified.user, accepted, ""

    def _verify(self, token: str) -> _Verified | None:
        """A token's signature checked and its claims read (what never changes for one token); None
        when it is not one this server signed. Whether it is still valid is checked per request."""
        head, body, sig = token.split(".")
        want = hmac.new(self.signing_key, f"{head}.{body}".encode(), hashlib.sha256).digest()
        try:
            if not hmac.compare_digest(_unb64(sig), want):
                return None
            claims = msgspec.json.decode(_unb64(body))
        except (ValueError, msgspec.DecodeError):
            return None
        if not isinstance(claims, dict):
            return None
        aud = claims.get("aud")
        k8s = claims.get("kubernetes.io") or {}
        namespace = k8s.get("namespace", "")
        sa = k8s.get("serviceaccount") or {}
        extra: dict[str, list[str]] = {}
        pod = k8s.get("pod")
        bound_pod: tuple[str, str | None] | None = None
        if isinstance(pod, dict):
            bound_pod = (pod.get("name", ""), pod.get("uid"))
            extra = {f"{EXTRA}pod-name": [str(pod.get("name", ""))], f"{EXTRA}pod-uid": [str(pod.get("uid", ""))]}
            node = k8s.get("node")
            if isinstance(node, dict) and node.get("name"):
                extra[f"{EXTRA}node-name"] = [node["name"]]
                if node.get("uid"):
                    extra[f"{EXTRA}node-uid"] = [node["uid"]]
        if claims.get("jti"):
            extra[f"{EXTRA}credential-id"] = [f"JTI={claims['jti']}"]
        user = service_account_user(namespace, sa.get("name", ""), sa.get("uid", ""))
        return _Verified(
            int(claims.get("exp") or 0),
            tuple([aud] if isinstance(aud, str) else list(aud or [])),
            namespace,
            sa.get("name", ""),
            sa.get("uid"),
            bound_pod,
            UserInfo(user.username, user.uid, user.groups, extra),
        )


_VERIFIED_TOKENS = 4096  # verified tokens kept (their signature and claims), per server


class _Verified(msgspec.Struct, frozen=True):
    """What a ServiceAccount token says, once its signature is checked."""

    expires: int
    audiences: tuple[str, ...]
    namespace: str
    sa_name: str
    sa_uid: str | None
    pod: tuple[str, str | None] | None
    user: UserInfo


# Whoever calls a server that checks no token (plain HTTP without one): everything is allowed.
OPEN_USER = UserInfo("system:anonymous", "", (MASTERS,))
