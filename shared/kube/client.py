"""The one way a service gets its Kubernetes client: a kubeconfig file, an API URL and token, or in-cluster.

TLS verification of the API server is never silently off: an https URL without a CA file is
verified against the system's trust store, and skipping verification takes the explicit
`insecure_skip_tls_verify` (the publisher's `--api-insecure-skip-tls-verify`), logged as a warning
at every start.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from shared.kube.kubeconfig import JsonKubeconfig, load_json_kubeconfig
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
    of concurrent requests would otherwise keep that memory until the pool lets them go (aiohttp's pool
    hands its idle connections out in turn: under a steady load none idles out, so all stay open).
    The caller closes it (`async with`, or `await api.close()`)."""
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    loaded: JsonKubeconfig | None = None
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
            elif (loaded := await asyncio.to_thread(load_json_kubeconfig, kubeconfig, configuration)) is None:
                await config.load_kube_config(config_file=kubeconfig or None, client_configuration=configuration)
        except Exception as exc:  # noqa: BLE001 - kubeconfig and in-cluster loading raise many types
            raise KubeConfigError(
                f"cannot configure the Kubernetes client: {exc}; give --kubeconfig (or "
                "KUBECONFIG) or run in a pod with a ServiceAccount"
            ) from exc
    if max_connections > 0:
        configuration.connection_pool_maxsize = max_connections
    try:
        api = client.ApiClient(configuration)  # its TLS context reads the CA and the client pair now
    finally:
        if loaded is not None:  # the files decoded from the kubeconfig: no key stays on disk
            await asyncio.to_thread(loaded.remove_files)
    _without_env_lookups(api, configuration)
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
    old.detach()  # the connector now belongs to the new session; the old one closes nothing
