"""The one way a service gets its Kubernetes client: a kubeconfig file, an API URL and token, or in-cluster.

TLS verification of the API server is never silently off: an https URL without a CA file is
verified against the system's trust store, and skipping verification takes the explicit
`insecure_skip_tls_verify` (the publisher's `--api-insecure-skip-tls-verify`), logged as a warning
at every start.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from typing import Any

from shared.kube.kubeconfig import load_json_kubeconfig
from shared.logs import get_logger

log = get_logger(__name__)


class KubeConfigError(RuntimeError):
    """No Kubernetes client could be configured (kubeconfig missing or malformed, in-cluster files
    unreadable); the message says what to give instead."""


async def kube_api_client(
    kubeconfig: str = "",
    *,
    url: str = "",
    token: str = "",
    ca_file: str = "",
    insecure_skip_tls_verify: bool = False,
    max_connections: int = 0,
) -> Any:
    """A kubernetes-asyncio ApiClient, from the first that applies: `url` (with a bearer `token` and
    the `ca_file` that signs its certificate), in-cluster credentials when no kubeconfig is given and
    the process runs in a pod, else the kubeconfig file (`KUBECONFIG` / `~/.kube/config` when empty): a
    JSON one with the common fields without PyYAML or kubernetes-asyncio's loader (`shared.kube.kubeconfig`,
    ~1 MB of RSS less), any other through the loader.
    `max_connections` (0: kubernetes-asyncio's 100) bounds the connections open to the API server at
    once: each TLS connection holds a 256 KiB read buffer of asyncio's plus OpenSSL's state, so a burst
    of concurrent requests would otherwise keep that memory until the pool lets them go.
    The caller closes it (`async with`, or `await api.close()`)."""
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    if url:
        configuration.host = url.rstrip("/")
        if token:
            configuration.api_key = {"BearerToken": token}
            configuration.api_key_prefix = {"BearerToken": "Bearer"}
        if ca_file:
            configuration.ssl_ca_cert = ca_file
        if insecure_skip_tls_verify:
            configuration.verify_ssl = False
            log.warning(
                "TLS verification of the API server is OFF (--api-insecure-skip-tls-verify): anyone on "
                "the path can read the token and the traffic; give --api-ca-file instead",
                url=url,
            )
    elif insecure_skip_tls_verify:
        raise ValueError("insecure_skip_tls_verify applies to an API URL only; a kubeconfig says it itself")
    else:
        in_cluster = not kubeconfig and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
        if not in_cluster:
            _check_kubeconfig_file(kubeconfig)
        try:
            if in_cluster:
                config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            elif not await asyncio.to_thread(load_json_kubeconfig, kubeconfig, configuration):
                await config.load_kube_config(config_file=kubeconfig or None, client_configuration=configuration)
        except Exception as exc:  # noqa: BLE001 - kubeconfig and in-cluster loading raise many types
            raise KubeConfigError(
                f"cannot configure the Kubernetes client: {exc}; give --kubeconfig (or "
                "KUBECONFIG) or run in a pod with a ServiceAccount"
            ) from exc
    if max_connections > 0:
        configuration.connection_pool_maxsize = max_connections
    api = client.ApiClient(configuration)
    _without_env_lookups(api, configuration)
    _most_recent_first(api.rest_client.pool_manager.connector)
    _trust_store_on_demand()
    return api


def _check_kubeconfig_file(kubeconfig: str) -> None:
    """KubeConfigError naming the kubeconfig file (given, KUBECONFIG's only one, or ~/.kube/config) when it
    cannot be read: kubernetes-asyncio takes a missing file for an empty config and says a key is missing."""
    path = kubeconfig or os.environ.get("KUBECONFIG", "") or os.path.expanduser("~/.kube/config")
    if os.pathsep in path:
        return  # several files, merged by the loader
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        source = "--kubeconfig" if kubeconfig else ("KUBECONFIG" if os.environ.get("KUBECONFIG") else "default")
        raise KubeConfigError(
            f"cannot read the kubeconfig {path} ({source}): {exc.strerror}; give --kubeconfig "
            "(or KUBECONFIG) or run in a pod with a ServiceAccount"
        ) from None


_PROXY_VARIABLES = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")


def _without_env_lookups(api: Any, configuration: Any) -> None:
    """kubernetes-asyncio opens its aiohttp session with `trust_env=True`, which makes every request
    look up `.netrc` and proxy settings in an executor thread (~2 ms of a 0.5 ms GET). With no proxy
    variable set there is nothing to find: the session is reopened without the lookups. With one set,
    the proxy is honoured as client-go does (from the environment), so the session stays as it is."""
    import aiohttp

    if configuration.proxy or any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return
    rest = api.rest_client
    old = rest.pool_manager
    rest.pool_manager = aiohttp.ClientSession(
        connector=old.connector, connector_owner=True, trust_env=False, read_bufsize=2**21
    )
    old._connector = None  # the connector now belongs to the new session; the old one closes nothing


def _most_recent_first(connector: Any) -> None:
    """The pool hands out the connection released last, not the one idle longest. aiohttp's pool is first in,
    first out: under any steady load every connection a burst opened is reused in turn and none is ever idle
    for aiohttp's keep-alive (15 s), so each keeps its TLS read buffer (256 KiB) and OpenSSL's state for good.
    Most recent first, a steady load runs on one connection and the burst's others close 15-30 s after it
    (client-go's pool is the same: the idle connection used last is reused first)."""
    release = connector._release

    def _release(key: Any, protocol: Any, *, should_close: bool = False) -> None:
        release(key, protocol, should_close=should_close)
        idle = connector._conns.get(key)
        if idle and idle[-1][0] is protocol:  # released into the pool (not closed): first in line
            idle.rotate(1)

    connector._release = _release


class _StoreOnFirstHandshake(ssl.SSLContext):
    """A client TLS context that loads the default trust store (`load_default_certs`, which honours
    SSL_CERT_FILE/SSL_CERT_DIR) when its first connection starts, not when it is made."""

    _loaded = False

    def _load(self) -> None:
        if not self._loaded:
            self.load_default_certs(ssl.Purpose.SERVER_AUTH)
            self._loaded = True

    def wrap_bio(self, *args: Any, **kwargs: Any) -> Any:  # asyncio's TLS transport
        self._load()
        return super().wrap_bio(*args, **kwargs)

    def wrap_socket(self, *args: Any, **kwargs: Any) -> Any:  # a blocking socket
        self._load()
        return super().wrap_socket(*args, **kwargs)


def _trust_store_on_demand() -> None:
    """aiohttp makes two default TLS contexts when it is imported, each with the whole system trust
    store parsed into it (~150 CA certificates; ~1.5 MB of RSS together), for the requests that bring
    no context of their own. This client always brings its own (the cluster's CA, or the system's
    when an https URL comes without one), so in our processes they usually serve nothing. They are
    replaced by contexts with the same settings that load the store at their first handshake: a
    request that does use them behaves as before."""
    from aiohttp import connector

    if not isinstance(getattr(connector, "_SSL_CONTEXT_VERIFIED", None), ssl.SSLContext) or isinstance(
        connector._SSL_CONTEXT_VERIFIED, _StoreOnFirstHandshake
    ):
        return
    verified = _StoreOnFirstHandshake(ssl.PROTOCOL_TLS_CLIENT)  # as ssl.create_default_context() makes it
    verified.verify_mode = ssl.CERT_REQUIRED
    verified.check_hostname = True
    unverified = _StoreOnFirstHandshake(ssl.PROTOCOL_TLS_CLIENT)  # as aiohttp makes its unverified one
    unverified.options |= ssl.OP_NO_SSLv2 | ssl.OP_NO_SSLv3 | ssl.OP_NO_COMPRESSION
    unverified.check_hostname = False
    unverified.verify_mode = ssl.CERT_NONE
    for context in (verified, unverified):
        context.set_alpn_protocols(("http/1.1",))
    connector._SSL_CONTEXT_VERIFIED = verified
    connector._SSL_CONTEXT_UNVERIFIED = unverified
