"""The NATS connection of a service: who it logs in as (password, TLS, .creds, a ServiceAccount token for the
auth callout), the subject tokens of that identity (inbox prefix, dead-letter subjects), and `dial`: connect
with backoff, give up on a refused login with a message saying what to fix, then reconnect forever.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import urllib.parse
from collections.abc import Callable
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from prometheus_client import Counter, Gauge

from shared.backoff import Backoff
from shared.events.catalog import (
    NODE_ROLES,
)
from shared.logs import get_logger
from shared.natsjwt import Creds, CredsError

log = get_logger(__name__)
NATS_CONNECTED = Gauge("gpu_dra_nats_connected", "1 while the client's NATS connection is up", ["client"])
NATS_RECONNECTS = Counter("gpu_dra_nats_reconnects", "NATS reconnections after a lost connection", ["client"])
_CONSUMER_NAME = re.compile(r"[^A-Za-z0-9_-]")


class BusError(RuntimeError):
    """The bus could not do what was asked (not connected, no reply, bad reply)."""


class LoginRefused(BusError):
    """NATS refused the client's credentials (Bus.connect gave up; retrying will not help until they change)."""


class NatsTLS(msgspec.Struct, frozen=True, kw_only=True):
    """How a client proves who it is and checks the server, beyond user/password.

    `ca_file`: verify the server's certificate against this CA (a tls:// URL without it uses the
    system CAs). `cert_file`/`key_file`: a client certificate (servers with `verify: true`).
    `creds_file`: a NATS .creds file (user JWT + NKEY seed, from `gpu-dra nats credentials`); with
    it no password is sent and the user name only names the client's inbox prefix and dead-letter
    subjects (when no user is given, the JWT's name does). `token_file`: a projected ServiceAccount
    token (audience `nats`) sent as the auth token with the sentinel's creds, for the auth callout
    (services/authcallout) to decide who the client is; the user name is the identity asked for
    (`preparer.<node>`), and the file is read again at every connect, as the kubelet rotates it."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    creds_file: str = ""
    token_file: str = ""

    @property
    def signs(self) -> bool:
        return bool(self.creds_file)

    def _context(self) -> ssl.SSLContext | None:
        if not (self.ca_file or self.cert_file or self.key_file):
            return None
        if bool(self.cert_file) != bool(self.key_file):
            raise BusError("a NATS client certificate needs both GPU_DRA_NATS_TLS_CERT and GPU_DRA_NATS_TLS_KEY")
        try:
            context = ssl.create_default_context(cafile=self.ca_file or None)
            if self.cert_file:
                context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise BusError(f"cannot load the NATS TLS files ({exc}); check GPU_DRA_NATS_TLS_CA/_CERT/_KEY") from exc
        return context

    def _creds(self) -> Creds:
        try:
            with open(self.creds_file, encoding="utf-8") as handle:
                return Creds(handle.read())
        except OSError as exc:
            raise BusError(
                f"cannot read NATS credentials {self.creds_file} ({exc}); mount the Secret that "
                "`gpu-dra nats credentials` wrote, or set GPU_DRA_NATS_CREDS to its file"
            ) from exc
        except CredsError as exc:
            raise BusError(
                f"NATS credentials {self.creds_file} are not usable ({exc}); write them again "
                "with `gpu-dra nats credentials`"
            ) from exc

    async def connect_options(self) -> tuple[dict[str, Any], str | None]:
        """nats-py connect() keyword arguments and the creds' user name (files read off the event loop)."""
        options: dict[str, Any] = {}
        context = await asyncio.to_thread(self._context)
        if context is not None:
            options["tls"] = context
        if not self.creds_file:
            if self.token_file:
                raise BusError(
                    "GPU_DRA_NATS_TOKEN_FILE needs GPU_DRA_NATS_CREDS: the sentinel's creds "
                    "(Secret gpu-dra-nats-sentinel) that route the connect to the auth callout"
                )
            return options, None
        creds = await asyncio.to_thread(self._creds)
        options["user_jwt_cb"], options["signature_cb"] = creds.callbacks()
        if self.token_file:
            await asyncio.to_thread(self._token)  # a missing token fails now, with its name
            options["token"] = self._token
            return options, None  # the sentinel's name is not the client's identity
        return options, creds.name or None

    def _token(self) -> str:
        """The ServiceAccount token as it is now (nats-py asks at every connect, so a rotated token
        is used from the next reconnect on; a few hundred bytes from the kubelet's tmpfs)."""
        try:
            with open(self.token_file, encoding="utf-8") as handle:
                return handle.read().strip()
        except OSError as exc:
            raise BusError(
                f"cannot read the NATS token {self.token_file} ({exc}); mount a projected "
                "ServiceAccount token with audience nats there (deploy/kubernetes/base/node-agents.yaml)"
            ) from exc


def consumer_token(name: str) -> str:
    """A consumer name made safe as one subject token and durable name."""
    return _CONSUMER_NAME.sub("_", name) or "consumer"


def identity_token(user: str) -> str:
    """The subject token of a NATS user (`preparer.gpu-a` -> `preparer_gpu-a`): its inbox prefix and
    dead-letter subjects carry it, and its permissions name it."""
    return consumer_token(user)


def url_user(url: str) -> str | None:
    """The user named in a NATS URL's credentials (`nats://user:pass@host`), first server first."""
    for server in url.split(","):
        name = urllib.parse.urlsplit(server.strip()).username
        if name:
            return urllib.parse.unquote(name)
    return None


def node_identity(user: str | None) -> tuple[str, str] | None:
    """(role, node) of a node service's NATS user (`preparer.gpu-a`), None for any other user."""
    role, _, node = (user or "").partition(".")
    return (role, node) if role in NODE_ROLES and node else None


def inbox_prefix(user: str | None) -> str:
    """Where a client takes replies: `_INBOX_<identity>` for a named user, nats' default otherwise."""
    return f"_INBOX_{identity_token(user)}" if user else "_INBOX"


async def dial(
    url: str,
    *,
    name: str,
    connect_timeout: float = 2.0,
    initial_attempts: int = 30,
    login_attempts: int = 3,
    reconnect_wait: float = 0.25,
    user: str | None = None,
    password: str | None = None,
    tls: NatsTLS | None = None,
    reconnected: Callable[[], object] = lambda: None,
) -> tuple[NatsClient, str | None]:
    """Connect with backoff; once connected, reconnect forever on loss.

    A server that cannot be reached is tried `initial_attempts` times (backoff 0.1 s doubling to
    2 s). A server that refuses the login (wrong password, unknown user, revoked or foreign
    creds) is tried `login_attempts` times, then BusError says what was refused, for which user
    or creds file, and what to do: the service exits non-zero instead of waiting forever.
    `user` also names the client's inbox prefix (`_INBOX_<identity>`); `tls` adds a CA, a client
    certificate, a NATS .creds file or an NKEY seed file (see NatsTLS); `reconnected()` is called
    after every reconnect. The client and the identity it logged in as."""
    tls = tls or NatsTLS()
    options, creds_user = await tls.connect_options()
    if user and creds_user and user != creds_user:
        raise BusError(
            f"GPU_DRA_NATS_USER is {user!r} but the creds file is for {creds_user!r}: the inbox and "
            "dead-letter subjects would not be the ones its permissions allow; fix either one"
        )
    identity = user or creds_user or url_user(url)
    if tls.token_file and not user:
        raise BusError(
            "GPU_DRA_NATS_TOKEN_FILE needs GPU_DRA_NATS_USER: the identity the auth callout is "
            "asked for (e.g. preparer.<node>)"
        )
    login = None if tls.signs else user

    async def on_disconnect() -> None:
        if not (nc.is_closed or nc.is_draining):  # our own close() is no news
            log.warning("nats disconnected", client=name)
            NATS_CONNECTED.labels(name).set(0)

    async def on_reconnect() -> None:
        log.info("nats reconnected", client=name, server=str(nc.connected_url.netloc if nc.connected_url else ""))
        NATS_CONNECTED.labels(name).set(1)
        NATS_RECONNECTS.labels(name).inc()
        reconnected()

    dial_errors: list[Exception] = []  # the last dial's error (nats-py reports it here, then "no servers")

    async def on_error(exc: Exception) -> None:
        dial_errors[:] = [exc]
        log.warning("nats error", client=name, error=str(exc) or type(exc).__name__)

    def refused_login(exc: Exception) -> bool:
        text = str(exc).lower()
        return isinstance(exc, nats.errors.Error) and ("authorization violation" in text or "authentication" in text)

    def who() -> str:
        if tls.token_file:
            return f"the token in {tls.token_file} asking the auth callout for user {identity!r}"
        if tls.creds_file:
            return f"creds file {tls.creds_file} (user {creds_user!r})"
        if login:
            return f"user {login!r} (GPU_DRA_NATS_USER with GPU_DRA_NATS_PASSWORD)"
        if identity:
            return f"user {identity!r} (from GPU_DRA_NATS_URL)"
        return "an anonymous client (neither GPU_DRA_NATS_USER nor GPU_DRA_NATS_CREDS is set)"

    servers = url.split(",")
    shown = re.sub(r"//[^/@,]*@", "//", url)  # no password in an error message
    backoff = Backoff(initial_s=0.1, cap_s=2.0)
    last_error: Exception | None = None
    unreachable = refusals = 0
    while True:
        nc = NatsClient()
        try:
            # A bounded try per attempt (a refused login raises at once, an unreachable pool after two
            # dials per server): this loop decides whether to try again, with its backoff.
            await nc.connect(
                servers=servers,
                # with a token the connection's name is the identity asked of the auth callout
                name=identity if tls.token_file else name,
                connect_timeout=int(max(1, connect_timeout)),
                reconnect_time_wait=reconnect_wait,  # type: ignore[arg-type]
                max_reconnect_attempts=1,
                allow_reconnect=False,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                error_cb=on_error,
                user=login,
                password=password if login else None,
                ping_interval=5,
                max_outstanding_pings=2,
                inbox_prefix=inbox_prefix(identity),
                **options,
            )
        except Exception as exc:  # noqa: BLE001 - classified just below
            last_error = exc
            try:
                await nc.close()  # a failed first try leaves its socket open
            except Exception:  # noqa: BLE001 - closing a half-open client is best effort
                log.debug("closing a failed NATS client failed", client=name)
            if refused_login(exc):
                refusals += 1
                if refusals >= max(1, login_attempts):
                    raise LoginRefused(
                        f"NATS at {shown} refused the login of {who()} {refusals} times ({exc}): the "
                        "password or creds do not match a user the server knows, or the user was revoked; "
                        "give this service the credentials `gpu-dra nats credentials` wrote for it (its "
                        "Secret), re-run that command if the user was rotated, then restart it"
                    ) from None
            else:
                unreachable += 1
                if isinstance(exc, nats.errors.NoServersError) and dial_errors:
                    last_error = dial_errors[0]
                if unreachable >= max(1, initial_attempts):
                    raise BusError(
                        f"cannot connect to NATS at {shown} after {unreachable} attempts: "
                        f"{str(last_error) or type(last_error).__name__}; "
                        "check GPU_DRA_NATS_URL and that the server is up"
                    ) from None
            await asyncio.sleep(backoff.next())
            continue
        # once in, a lost connection is redialled forever (nats-py reads these at each disconnect)
        nc.options["allow_reconnect"] = True
        nc.options["max_reconnect_attempts"] = -1
        NATS_CONNECTED.labels(name).set(1)
        return nc, identity
