"""A JSON kubeconfig read without PyYAML and without kubernetes-asyncio's kubeconfig loader.

kubernetes-asyncio's `load_kube_config` imports PyYAML and its exec/OIDC/GCP auth machinery: ~1 MB of
RSS in a process that keeps its client for good (the preparer). A kubeconfig written as JSON (JSON is
YAML: kubectl and every client read it) with the common fields is read here instead, and the client's
`Configuration` gets what the loader would give it, field for field:

- the context `current-context` names, its cluster and its user (none: no credentials);
- `host` from the cluster's `server` (trailing `/` dropped); for an https server, `ssl_ca_cert` from
  `certificate-authority-data` (decoded into a temporary file of its own, 0600, that the caller removes as
  soon as the client has read it: `JsonKubeconfig.remove_files`) or `certificate-authority` (relative to the
  kubeconfig's folder), and `cert_file` / `key_file` the same way from the user's
  `client-certificate[-data]` / `client-key[-data]`: a client key is on disk only while the client is built,
  where the loader keeps its files until the process exits (and a process killed leaves them);
- `verify_ssl` from `insecure-skip-tls-verify`, `tls_server_name`, `proxy` from `proxy-url`;
- a bearer `token` as the loader sets it (`api_key["BearerToken"] = "Bearer <token>"`).

Anything else returns False and the caller falls back to the loader, which reads it as before: a YAML
file, several files in KUBECONFIG, a user with `exec`, `auth-provider`, `tokenFile` or a username and
password, a context or cluster that is not there, a file that does not exist (the loader's error then
says which).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import tempfile
from typing import Any

import msgspec


class _Named(msgspec.Struct):
    name: str


class _Cluster(msgspec.Struct, rename="kebab"):
    server: str | None = None
    certificate_authority: str | None = None
    certificate_authority_data: str | None = None
    insecure_skip_tls_verify: bool | None = None
    tls_server_name: str | None = None
    proxy_url: str | None = None


class _NamedCluster(_Named):
    cluster: _Cluster


class _User(msgspec.Struct, rename="kebab"):
    token: str | None = None
    client_certificate: str | None = None
    client_certificate_data: str | None = None
    client_key: str | None = None
    client_key_data: str | None = None
    # what this reader leaves to the loader
    exec: Any = None
    auth_provider: Any = None
    token_file: Any = msgspec.field(default=None, name="tokenFile")
    username: Any = None
    password: Any = None


class _NamedUser(_Named):
    user: _User | None = None


class _Context(msgspec.Struct):
    cluster: str
    user: str | None = None


class _NamedContext(_Named):
    context: _Context


class _KubeConfig(msgspec.Struct, rename="kebab"):
    current_context: str | None = None
    clusters: list[_NamedCluster] | None = None
    users: list[_NamedUser] | None = None
    contexts: list[_NamedContext] | None = None


_DECODER = msgspec.json.Decoder(_KubeConfig)


class JsonKubeconfig:
    """What `load_json_kubeconfig` read: the temporary files it wrote (`*-data` fields decoded), for the caller
    to remove once the client has loaded them into its TLS context."""

    def __init__(self) -> None:
        self.files: list[str] = []

    def remove_files(self) -> None:
        """Blocking (unlinks files): call it from a worker thread."""
        for name in self.files:
            with contextlib.suppress(OSError):
                os.remove(name)
        self.files.clear()


def _data_file(data: str, written: list[str]) -> str | None:
    """The base64 `data` decoded into a new file readable by its owner only (its name added to `written`); None
    when it is not base64."""
    try:
        content = base64.standard_b64decode(data.encode())
    except (binascii.Error, ValueError):
        return None
    fd, name = tempfile.mkstemp()  # mode 0600
    written.append(name)
    with os.fdopen(fd, "wb") as f:
        f.write(content)
    return name


class _NotCovered(Exception):
    """The kubeconfig needs the loader."""


def _file_or_data(file: str | None, data: str | None, base: str, written: list[str]) -> str | None:
    if data is not None:  # the loader prefers the data, even an empty one
        if not data:
            return None
        name = _data_file(data, written)
        if name is None:
            raise _NotCovered
        return name
    if file:
        path = os.path.normpath(os.path.join(base, file))
        if not os.path.isfile(path):
            raise _NotCovered  # the loader says which file is missing
        return path
    return None


def _one_path(kubeconfig: str) -> str | None:
    """The single file a kubeconfig argument names, as the loader would pick it; None for several."""
    path = kubeconfig or os.environ.get("KUBECONFIG", "~/.kube/config")
    if os.pathsep in path:
        return None
    return os.path.expanduser(path)


def load_json_kubeconfig(kubeconfig: str, configuration: Any) -> JsonKubeconfig | None:
    """Set `configuration` (a kubernetes-asyncio `Configuration`) from a JSON kubeconfig as the loader would;
    None, with `configuration` untouched and no file left, when the file is not one this reader covers (module
    doc). The caller removes the result's files once its client is built. Blocking (reads and writes files):
    call it from a worker thread."""
    path = _one_path(kubeconfig)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if not raw.lstrip().startswith(b"{"):
        return None
    loaded = JsonKubeconfig()
    try:
        config = _DECODER.decode(raw)
        fields = _fields(config, os.path.dirname(os.path.abspath(path)), loaded.files)
    except (msgspec.ValidationError, msgspec.DecodeError, _NotCovered):
        loaded.remove_files()
        return None
    except BaseException:  # a write that failed half-way: nothing decoded stays behind either
        loaded.remove_files()
        raise
    token = fields.pop("token", None)
    if token is not None:
        configuration.api_key["BearerToken"] = token
    for key, value in fields.items():
        setattr(configuration, key, value)
    return loaded


def _by_name(items: list[Any] | None, name: str | None) -> Any:
    for item in items or []:
        if item.name == name:
            return item
    raise _NotCovered


def _fields(config: _KubeConfig, base: str, written: list[str]) -> dict[str, Any]:
    """What the loader's `_set_config` copies into a Configuration, for this kubeconfig (the files it decodes
    named in `written`)."""
    if not config.current_context:
        raise _NotCovered
    context = _by_name(config.contexts, config.current_context).context
    cluster = _by_name(config.clusters, context.cluster).cluster
    user = _User()
    if context.user and config.users:
        named = next((u for u in config.users if u.name == context.user), None)
        user = named.user if named is not None and named.user is not None else _User()
    if (
        user.exec is not None
        or user.auth_provider is not None
        or user.token_file is not None
        or user.username is not None
        or user.password is not None
    ):
        raise _NotCovered
    fields: dict[str, Any] = {}
    if user.token:
        fields["token"] = f"Bearer {user.token}"
    if cluster.server is not None:
        fields["host"] = cluster.server.rstrip("/")
        if fields["host"].startswith("https"):
            fields["ssl_ca_cert"] = _file_or_data(
                cluster.certificate_authority, cluster.certificate_authority_data, base, written
            )
            fields["cert_file"] = _file_or_data(user.client_certificate, user.client_certificate_data, base, written)
            fields["key_file"] = _file_or_data(user.client_key, user.client_key_data, base, written)
    if cluster.insecure_skip_tls_verify is not None:
        fields["verify_ssl"] = not cluster.insecure_skip_tls_verify
    if cluster.tls_server_name is not None:
        fields["tls_server_name"] = cluster.tls_server_name
    if cluster.proxy_url is not None:
        fields["proxy"] = cluster.proxy_url
    return fields
