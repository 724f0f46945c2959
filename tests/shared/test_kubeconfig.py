"""shared.kube.kubeconfig: a JSON kubeconfig gives the client the Configuration kubernetes-asyncio's loader gives
it from the same file (field for field; a file the loader makes from `*-data` compared by its content), anything
it does not cover goes to the loader, and the kubeconfig the embedded API server writes is JSON that a client
made from it uses over TLS; the files decoded from `*-data` (a client key among them) are gone once the client
is built. That it is read without PyYAML is checked on the preparer's own start-up
(tests/preparer/test_footprint.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import config as loader
from kubernetes_asyncio.client import Configuration, VersionApi

from embedded.apiserver.testing import running_apiserver
from shared.kube.client import kube_api_client
from shared.kube.kubeconfig import load_json_kubeconfig
from shared.selfsigned import make_pair


def _b64(data: bytes) -> str:
    return base64.standard_b64encode(data).decode()


def _kubeconfig(cluster: dict[str, Any], user: dict[str, Any] | None, *, current: str = "x") -> dict[str, Any]:
    """Two contexts (the other one's cluster and user differ), `current` chosen."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "preferences": {},
        "clusters": [{"name": "other", "cluster": {"server": "https://other:1"}}, {"name": "c", "cluster": cluster}],
        "users": [{"name": "o", "user": {"token": "other"}}]
        + ([{"name": "u", "user": user}] if user is not None else []),
        "contexts": [
            {"name": "o", "context": {"cluster": "other", "user": "o"}},
            {"name": "x", "context": {"cluster": "c", **({"user": "u"} if user is not None else {})}},
        ],
        "current-context": current,
    }


CASES = {
    "CA data and token": _kubeconfig(
        {"server": "https://10.0.0.1:6443/", "certificate-authority-data": _b64(b"CA PEM")}, {"token": "secret"}
    ),
    "client certificate data and a CA file beside the kubeconfig": _kubeconfig(
        {"server": "https://api.example:443", "certificate-authority": "ca.pem"},
        {"client-certificate-data": _b64(b"CERT PEM"), "client-key-data": _b64(b"KEY PEM")},
    ),
    "client certificate files, insecure, server name and proxy": _kubeconfig(
        {
            "server": "https://10.0.0.1:6443",
            "insecure-skip-tls-verify": True,
            "tls-server-name": "kubernetes",
            "proxy-url": "http://proxy:3128",
        },
        {"client-certificate": "certs/client.pem", "client-key": "certs/client.key", "token": "t"},
    ),
    "plain http, no user": _kubeconfig({"server": "http://127.0.0.1:8080"}, None),
}

FIELDS = ("host", "verify_ssl", "tls_server_name", "proxy", "api_key", "api_key_prefix")
FILES = ("ssl_ca_cert", "cert_file", "key_file")


def _seen(configuration: Configuration) -> dict[str, Any]:
    """The fields the loader sets; a file by its content (the loader's temporary files have names of their own)."""
    seen = {name: getattr(configuration, name) for name in FIELDS}
    for name in FILES:
        path = getattr(configuration, name)
        seen[name] = Path(path).read_bytes() if path else None
    return seen


@pytest.mark.parametrize("case", list(CASES))
async def test_json_kubeconfig_gives_what_the_loader_gives(tmp_path: Path, case: str) -> None:
    (tmp_path / "ca.pem").write_bytes(b"CA FILE")
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "client.pem").write_bytes(b"CERT FILE")
    (tmp_path / "certs" / "client.key").write_bytes(b"KEY FILE")
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(CASES[case]))

    fast = Configuration()
    loaded = load_json_kubeconfig(str(path), fast)
    assert loaded is not None
    expected = Configuration()
    await loader.load_kube_config(config_file=str(path), client_configuration=expected, persist_config=False)
    assert _seen(fast) == _seen(expected)
    decoded = [
        getattr(fast, name) for name in FILES if getattr(fast, name) and str(tmp_path) not in getattr(fast, name)
    ]
    assert sorted(loaded.files) == sorted(decoded), "every file decoded from *-data, and only those, is the caller's"
    for name in decoded:
        assert os.stat(name).st_mode & 0o077 == 0, "a credential's file is readable by others"
    loaded.remove_files()
    assert not [name for name in decoded if os.path.exists(name)]
    assert all(os.path.exists(getattr(fast, name)) for name in FILES if getattr(fast, name) not in (None, *decoded))


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("apiVersion: v1\nkind: Config\ncurrent-context: x\n", "YAML"),
        (json.dumps(_kubeconfig({"server": "https://k"}, {"exec": {"command": "get-token"}})), "an exec plugin"),
        (json.dumps(_kubeconfig({"server": "https://k"}, {"auth-provider": {"name": "oidc"}})), "an auth provider"),
        (json.dumps(_kubeconfig({"server": "https://k"}, {"tokenFile": "/t"})), "a token file"),
        (json.dumps(_kubeconfig({"server": "https://k"}, {"username": "a", "password": "b"})), "basic auth"),
        (
            json.dumps(_kubeconfig({"server": "https://k", "certificate-authority": "missing.pem"}, None)),
            "a missing file",
        ),
        (json.dumps(_kubeconfig({"server": "https://k"}, None, current="gone")), "no such context"),
        (
            json.dumps(
                _kubeconfig(
                    {"server": "https://k", "certificate-authority-data": _b64(b"CA PEM")},
                    {"client-certificate-data": _b64(b"CERT PEM"), "client-key-data": "not base64!"},
                )
            ),
            "key data that is not base64, after the CA's was decoded",
        ),
    ],
)
def test_what_the_json_reader_does_not_cover_goes_to_the_loader(
    tmp_path: Path, text: str, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    configuration = Configuration()
    temp = tmp_path / "temp"  # where the reader's temporary files go (this test's own: other tests run beside it)
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    assert load_json_kubeconfig(str(path), configuration) is None, why
    assert list(temp.iterdir()) == [], "a kubeconfig left to the loader leaves no file"
    assert configuration.host == Configuration().host and configuration.api_key == {}
    assert load_json_kubeconfig(f"{path}:{path}", configuration) is None, "several files are merged by the loader"


async def test_the_servers_kubeconfig_is_json_and_a_client_from_it_works(tmp_path: Path) -> None:
    async with running_apiserver(tmp_path) as server:
        written = server.kubeconfig_path
        assert json.loads(written.read_text())["current-context"]
        assert os.stat(written).st_mode & 0o077 == 0
        # with a client pair as data too: the CA, the certificate and the key are on disk only while the client
        # is built (kubernetes-asyncio's loader keeps them until exit; a process killed leaves them behind)
        cert, key = await asyncio.to_thread(make_pair, tmp_path / "client", "client", common_name="c", sans=["DNS:c"])
        doc = json.loads(written.read_text())
        for user in doc["users"]:
            user["user"]["client-certificate-data"] = _b64(cert.read_bytes())
            user["user"]["client-key-data"] = _b64(key.read_bytes())
        with_pair = tmp_path / "with-pair.kubeconfig"
        with_pair.write_text(json.dumps(doc))
        api = await kube_api_client(str(with_pair))
        try:
            files = [api.configuration.ssl_ca_cert, api.configuration.cert_file, api.configuration.key_file]
            assert all(files) and api.configuration.verify_ssl  # TLS verified with the CA data
            assert not [name for name in files if os.path.exists(name)], "a decoded credential outlived the build"
            assert (await VersionApi(api).get_code()).git_version
        finally:
            await api.close()
        # the same kubeconfig as YAML still works, through the loader
        import yaml

        as_yaml = tmp_path / "yaml.kubeconfig"
        as_yaml.write_text(yaml.safe_dump(json.loads(written.read_text())))
        api = await kube_api_client(str(as_yaml))
        try:
            assert (await VersionApi(api).get_code()).git_version
        finally:
            await api.close()
