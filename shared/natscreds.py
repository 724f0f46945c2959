"""`gpu-dra nats credentials`: NATS decentralized (JWT/NKEY) credentials as Kubernetes Secrets.

Owns the deployment's NATS key material: one operator, one account (`GPU_DRA`, JetStream on) and a
system account, and one user per service identity with the permissions of shared.natsusers baked
into its signed JWT. Seeds live in `--credentials-dir` (0600, kept between runs, so adding nodes or
readers leaves every other credential valid); `--rotate USER` gives a user a new key and revokes the
old one in the account JWT. Writes Kubernetes Secrets (YAML on stdout, or `secrets.yaml` in
`--output`): `gpu-dra-nats-users` (the server's `users.conf`: operator JWT, MEMORY resolver with the
account JWTs preloaded), `gpu-dra-nats-route`, one per cluster service, one per node
(`gpu-dra-nats-node-<node>`: `<role>.creds` for its three services, only for `--nodes`) and one
per reader.

Node services need no per-node files: an auth callout account (`AUTH`) sends every connect of its
`sentinel` user (Secret `gpu-dra-nats-sentinel`, a bearer JWT that may do nothing by itself) to
`gpu-dra nats auth-callout` (services/authcallout), which checks the ServiceAccount token the client
sends and answers with a user JWT for that node's role. Its Secret `gpu-dra-nats-auth-callout` holds
its own creds and the issuer key, a signing key of both `AUTH` (for the responses) and `GPU_DRA` (for
the user JWTs it mints).

    gpu-dra nats credentials --reader billing=team-a,team-b --credentials-dir ./nats-keys
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shared import natsjwt
from shared.events.catalog import NODE_ROLES
from shared.natsusers import (
    CLUSTER_ROLES,
    DASHBOARD_READER,
    ROUTE_USER,
    Permissions,
    UsersError,
    all_users,
    check_node,
    node_user,
    reader_user,
    secret_object,
)
from shared.nkeys import KeyKind, KeyPair, NKeyError

ACCOUNT = "GPU_DRA"
SYSTEM_ACCOUNT = "SYS"
AUTH_ACCOUNT = "AUTH"
OPERATOR = "gpu-dra"
CALLOUT_USER = "auth-callout"  # the callout service's own user in AUTH (bypasses the callout)
SENTINEL_USER = "sentinel"  # what node services connect as; the callout decides who they are
CALLOUT_SUBJECT = "$SYS.REQ.USER.AUTH"


@dataclass
class Issued:
    """What one run produced: the server's config block and each user's .creds text."""

    server_config: str
    creds: dict[str, str]
    route_password: str
    callout: dict[str, str]  # Secret gpu-dra-nats-auth-callout: its creds, the issuer seed, the account keys
    sentinel: str  # the sentinel's .creds


class KeyStore:
    """Seeds under a directory, one `<name>.nk` file each (0600); an existing seed is kept."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.nk"

    def key(self, name: str, kind: KeyKind) -> KeyPair:
        path = self._path(name)
        if path.exists():
            try:
                return KeyPair.from_seed(path.read_text(), kind)
            except NKeyError as exc:
                raise UsersError(f"{path}: {exc}; delete it to mint a new key (and re-issue what it signed)") from None
        key = KeyPair.create(kind)
        self._write(path, key.seed + "\n")
        return key

    def rotate(self, name: str, kind: KeyKind) -> str:
        """Replace a user's key; returns the old public key ('' when it had none)."""
        path = self._path(name)
        old = self.key(name, kind).public_key if path.exists() else ""
        path.unlink(missing_ok=True)
        self.key(name, kind)
        return old

    def secret(self, name: str) -> str:
        path = self.directory / name
        if path.exists():
            return path.read_text().strip()
        value = secrets.token_urlsafe(32)
        self._write(path, value + "\n")
        return value

    def _write(self, path: Path, text: str) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)


def _revocations(store: KeyStore, rotated: Mapping[str, str]) -> dict[str, int]:
    path = store.directory / "revocations.json"
    revoked: dict[str, int] = json.loads(path.read_text()) if path.exists() else {}
    now = int(time.time())
    revoked |= {old: now for old in rotated.values() if old}
    if rotated:
        path.write_text(json.dumps(revoked, sort_keys=True, indent=1) + "\n")
        path.chmod(0o600)
    return revoked


def issue(users: Mapping[str, Permissions], credentials_dir: Path, rotate: list[str] | None = None) -> Issued:
    """Mint the operator/account JWTs and one .creds per user (keys kept in `credentials_dir`)."""
    store = KeyStore(credentials_dir)
    unknown = sorted(set(rotate or ()) - set(users))
    if unknown:
        raise UsersError(f"--rotate names no user of this deployment: {', '.join(unknown)}")
    rotated = {name: store.rotate(f"users/{name}", "user") for name in rotate or ()}
    operator = store.key("operator", "operator")
    account = store.key("account", "account")
    system = store.key("system-account", "account")
    revoked = _revocations(store, rotated)
    system_jwt = natsjwt.account_jwt(operator, system, SYSTEM_ACCOUNT, jetstream=False)
    operator_jwt = natsjwt.operator_jwt(operator, OPERATOR, system.public_key)
    auth = store.key("auth-account", "account")
    issuer = store.key("callout-issuer", "account")
    callout_user = store.key(f"users/{CALLOUT_USER}", "user")
    sentinel_user = store.key(f"users/{SENTINEL_USER}", "user")
    # GPU_DRA lets the issuer sign its users; AUTH lets it sign responses and calls out for all but the service.
    account_jwt = natsjwt.account_jwt(
        operator, account, ACCOUNT, jetstream=True, revocations=revoked, signing_keys=[issuer.public_key]
    )
    auth_jwt = natsjwt.account_jwt(
        operator,
        auth,
        AUTH_ACCOUNT,
        jetstream=False,
        signing_keys=[issuer.public_key],
        auth_users=[callout_user.public_key],
        allowed_accounts=[account.public_key],
    )
    callout_creds = natsjwt.creds_file(
        natsjwt.user_jwt(
            auth, callout_user, CALLOUT_USER, publish=[], subscribe=[CALLOUT_SUBJECT], allow_responses=True
        ),
        callout_user,
    )
    sentinel_creds = natsjwt.creds_file(
        natsjwt.user_jwt(
            auth, sentinel_user, SENTINEL_USER, publish=[], subscribe=[], allow_responses=False, bearer=True
        ),
        sentinel_user,
    )
    creds = {}
    for name, perms in sorted(users.items()):
        user = store.key(f"users/{name}", "user")
        token = natsjwt.user_jwt(
            account,
            user,
            name,
            publish=sorted(set(perms.publish)),
            subscribe=sorted(set(perms.subscribe)),
            allow_responses=perms.allow_responses,
            deny_publish=sorted(set(perms.deny_publish)),
        )
        creds[name] = natsjwt.creds_file(token, user)
    server_config = (
        "# Generated by `gpu-dra nats credentials`: do not edit; re-run it to add nodes or readers.\n"
        f"operator: {json.dumps(operator_jwt)}\n"
        f"system_account: {json.dumps(system.public_key)}\n"
        "resolver: MEMORY\n"
        "resolver_preload: {\n"
        f"  {account.public_key}: {json.dumps(account_jwt)}\n"
        f"  {system.public_key}: {json.dumps(system_jwt)}\n"
        f"  {auth.public_key}: {json.dumps(auth_jwt)}\n"
        "}\n"
    )
    callout = {
        "user.creds": callout_creds,
        "issuer.nk": issuer.seed + "\n",
        "account": account.public_key,
        "auth-account": auth.public_key,
    }
    return Issued(server_config, creds, store.secret("route.password"), callout, sentinel_creds)


def secrets_for(issued: Issued, nodes: list[str], readers: Mapping[str, list[str]]) -> list[dict[str, object]]:
    """The Kubernetes Secrets: the server's users.conf and route password, then one per identity."""
    out = [
        secret_object("gpu-dra-nats-users", {"users.conf": issued.server_config}),
        secret_object("gpu-dra-nats-route", {"user": ROUTE_USER, "password": issued.route_password}),
    ]
    out += [
        secret_object(f"gpu-dra-nats-{role}", {"user": role, "user.creds": issued.creds[role]})
        for role in CLUSTER_ROLES
    ]
    dashboard = reader_user(DASHBOARD_READER)
    out.append(secret_object("gpu-dra-nats-dashboard", {"user": dashboard, "user.creds": issued.creds[dashboard]}))
    out += [
        secret_object("gpu-dra-nats-auth-callout", issued.callout),
        secret_object("gpu-dra-nats-sentinel", {"sentinel.creds": issued.sentinel}),
    ]
    for node in nodes:
        out.append(
            secret_object(
                f"gpu-dra-nats-node-{node}",
                {f"{role}.creds": issued.creds[node_user(role, node)] for role in NODE_ROLES},
            )
        )
    for name in readers:
        out.append(secret_object(f"gpu-dra-nats-reader-{name}", {"user.creds": issued.creds[reader_user(name)]}))
    return out


def _readers(values: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for value in values:
        name, sep, namespaces = value.partition("=")
        granted = [ns.strip() for ns in namespaces.split(",") if ns.strip()]
        if not sep or not granted:
            raise UsersError(f"--reader {value!r}: expected NAME=namespace[,namespace...]")
        if name in out:
            raise UsersError(f"--reader {name!r} is given twice; list all its namespaces in one --reader")
        out[name] = granted
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-dra nats credentials", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--nodes",
        default="",
        help="comma-separated GPU node names that get per-node .creds "
        "files (not needed with the auth callout, which the shipped DaemonSet uses)",
    )
    parser.add_argument(
        "--reader",
        action="append",
        default=[],
        metavar="NAME=NS[,NS...]",
        help="a read-only third party that sees the claim events of these namespaces (repeatable)",
    )
    parser.add_argument(
        "--credentials-dir",
        required=True,
        type=Path,
        help="where the operator, account and user seeds are kept between runs (private, backed up)",
    )
    parser.add_argument(
        "--rotate",
        action="append",
        default=[],
        metavar="USER",
        help="give USER (e.g. preparer.gpu-a) a new key and revoke the old one (repeatable)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="write secrets.yaml into this directory (mode 0600) instead of printing it",
    )
    args = parser.parse_args(argv)
    nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
    try:
        for node in nodes:
            check_node(node)
        if len(set(nodes)) != len(nodes):
            raise UsersError("a node is listed twice in --nodes")
        readers = _readers(args.reader)
        users = all_users(nodes, readers)
        issued = issue(users, args.credentials_dir, args.rotate)
    except UsersError as exc:
        print(f"gpu-dra nats credentials: error: {exc}", file=sys.stderr)
        return 2
    text = "---\n".join(json.dumps(s, indent=2, sort_keys=True) + "\n" for s in secrets_for(issued, nodes, readers))
    if args.output is None:
        sys.stdout.write(text)
        return 0
    args.output.mkdir(parents=True, exist_ok=True)
    path = args.output / "secrets.yaml"
    path.write_text(text)
    path.chmod(0o600)
    print(
        f"wrote {path}: kubectl apply -f it (the NATS server reads gpu-dra-nats-users; restart it to load "
        "new accounts or revocations)",
        file=sys.stderr,
    )
    return 0
