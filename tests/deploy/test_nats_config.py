"""The shipped NATS configs pass `nats-server -t` (single server, cluster member, with TLS), a
missing per-server setting is refused by name, generated JWT users load, and the credentials
generator keeps keys, adds nodes, and refuses node names that cannot be one subject token without
writing anything."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from shared.natsserver import nats_server_binary
from tests.deploy.conftest import nats_layout, nats_users_module

SERVER_ENV = {
    "NATS_SERVER_NAME": "gpu-dra-nats-0",
    "NATS_CLIENT_PORT": "4222",
    "NATS_MONITOR_PORT": "8222",
    "NATS_CLUSTER_PORT": "6222",
    "NATS_ROUTE_PASSWORD": "route-pw",
    "NATS_ROUTE_0": "nats-route://route:route-pw@gpu-dra-nats-0.gpu-dra-nats-headless:6222",
    "NATS_ROUTE_1": "nats-route://route:route-pw@gpu-dra-nats-1.gpu-dra-nats-headless:6222",
    "NATS_ROUTE_2": "nats-route://route:route-pw@gpu-dra-nats-2.gpu-dra-nats-headless:6222",
}


def _check(config: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")} | env
    return subprocess.run(
        [nats_server_binary(), "-t", "-c", str(config)],
        capture_output=True,
        text=True,
        env=full,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize("config", ["nats.conf", "nats-cluster.conf"])
def test_nats_server_accepts_the_shipped_config(tmp_path: Path, config: str) -> None:
    config_dir = nats_layout(tmp_path, ["gpu-a", "gpu-b"])
    proc = _check(config_dir / config, SERVER_ENV | {"NATS_STORE_DIR": str(tmp_path / "js")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "is valid" in proc.stdout + proc.stderr


@pytest.mark.parametrize("config", ["nats.conf", "nats-cluster.conf"])
def test_nats_server_accepts_the_shipped_config_with_generated_jwt_users(tmp_path: Path, config: str) -> None:
    """users.conf as `gpu-dra nats credentials` writes it (operator JWT, MEMORY resolver)."""
    config_dir = nats_layout(tmp_path, ["gpu-a"])
    out = tmp_path / "out"
    assert (
        nats_users_module().main(
            ["--nodes", "gpu-a", "--credentials-dir", str(tmp_path / "keys"), "--output", str(out)]
        )
        == 0
    )
    docs = [json.loads(d) for d in (out / "secrets.yaml").read_text().split("---\n") if d.strip()]
    users_conf = next(d for d in docs if d["metadata"]["name"] == "gpu-dra-nats-users")["stringData"]["users.conf"]
    (tmp_path / "auth" / "users.conf").write_text(users_conf)
    proc = _check(config_dir / config, SERVER_ENV | {"NATS_STORE_DIR": str(tmp_path / "js")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "is valid" in proc.stdout + proc.stderr


def test_a_missing_per_server_setting_is_refused_by_name(tmp_path: Path) -> None:
    config_dir = nats_layout(tmp_path, ["gpu-a"])
    env = {k: v for k, v in SERVER_ENV.items() if k != "NATS_ROUTE_1"} | {"NATS_STORE_DIR": str(tmp_path / "js")}
    proc = _check(config_dir / "nats-cluster.conf", env)
    assert proc.returncode != 0
    assert "NATS_ROUTE_1" in proc.stdout + proc.stderr


def test_nats_server_accepts_the_config_with_tls_enabled(tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    if not openssl:
        pytest.skip("openssl is not installed: it makes the test certificate for the TLS config")
    config_dir = nats_layout(tmp_path, ["gpu-a"])
    tls_dir = tmp_path / "tls"
    tls_dir.mkdir()
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=gpu-dra-nats",
            "-keyout",
            str(tls_dir / "tls.key"),
            "-out",
            str(tls_dir / "tls.crt"),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    shutil.copy(tls_dir / "tls.crt", tls_dir / "ca.crt")
    tls = (config_dir / "tls.conf").read_text().replace("/etc/nats/tls", str(tls_dir))
    (config_dir / "tls.conf").write_text(tls)
    cluster = (config_dir / "nats-cluster.conf").read_text() + '\ninclude "tls.conf"\n'
    (config_dir / "nats-cluster-tls.conf").write_text(cluster)
    proc = _check(config_dir / "nats-cluster-tls.conf", SERVER_ENV | {"NATS_STORE_DIR": str(tmp_path / "js")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the commented include is the one switch docs/install.md tells operators to flip
    assert '# include "tls.conf"' in (config_dir / "nats.conf").read_text()


def test_generator_writes_secrets_and_keeps_keys_private_and_stable(tmp_path: Path) -> None:
    users = nats_users_module()
    keys, out = tmp_path / "keys", tmp_path / "out"
    assert users.main(["--nodes", "gpu-a", "--credentials-dir", str(keys), "--output", str(out)]) == 0
    seed = (keys / "users" / "discovery.gpu-a.nk").read_text()
    assert all(p.stat().st_mode & 0o077 == 0 for p in keys.rglob("*.nk"))
    assert (out / "secrets.yaml").stat().st_mode & 0o077 == 0
    assert users.main(["--nodes", "gpu-a,gpu-b", "--credentials-dir", str(keys), "--output", str(out)]) == 0
    assert (keys / "users" / "discovery.gpu-a.nk").read_text() == seed, "re-running changed a key"
    docs = [json.loads(d) for d in (out / "secrets.yaml").read_text().split("---\n") if d.strip()]
    names = {d["metadata"]["name"] for d in docs}
    assert names == {
        "gpu-dra-nats-users",
        "gpu-dra-nats-route",
        "gpu-dra-nats-publisher",
        "gpu-dra-nats-controller",
        "gpu-dra-nats-admin",
        "gpu-dra-nats-node-gpu-a",
        "gpu-dra-nats-node-gpu-b",
        "gpu-dra-nats-auth-callout",
        "gpu-dra-nats-sentinel",
        "gpu-dra-nats-dashboard",
        "gpu-dra-nats-gate",
    }
    users_conf = next(d for d in docs if d["metadata"]["name"] == "gpu-dra-nats-users")["stringData"]["users.conf"]
    assert "resolver: MEMORY" in users_conf and "operator:" in users_conf


@pytest.mark.parametrize(
    ("node", "complaint"),
    [
        ("ip-10-0-0-1.ec2.internal", "contains '.'"),
        ("GPU_A", "not a Kubernetes node name"),
    ],
)
def test_generator_refuses_bad_node_names_and_writes_nothing(
    tmp_path: Path, node: str, complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    users = nats_users_module()
    assert users.main(["--nodes", f"gpu-a,{node}", "--credentials-dir", str(tmp_path / "creds")]) == 2
    assert complaint in capsys.readouterr().err
    assert not (tmp_path / "creds").exists()
    with pytest.raises(users.UsersError, match="not a Kubernetes"):
        users.check_node("")
    with pytest.raises(users.UsersError, match="not a Kubernetes node name"):  # matched whole: no trailing newline
        users.check_node("gpu-b\n")
    with pytest.raises(users.UsersError, match="not a Kubernetes namespace"):
        users.check_namespace("team-a\n")


def test_generator_cli_reports_bad_input_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    users = nats_users_module()
    assert users.main(["--nodes", "a.b", "--credentials-dir", str(tmp_path / "c")]) == 2
    assert "contains '.'" in capsys.readouterr().err
    assert users.main(["--reader", "billing", "--credentials-dir", str(tmp_path / "c")]) == 2
    assert "expected NAME=namespace" in capsys.readouterr().err


def test_node_users_publish_only_subjects_naming_their_node() -> None:
    users = nats_users_module()
    for role in users.NODE_ROLES:
        perms = users.node_permissions(role, "gpu-a")
        for subject in perms.publish:
            if subject.startswith(("dra.v1.", "$KV.")) and not subject.startswith("dra.v1.deadletter."):
                assert "gpu-a" in subject.split("."), f"{role} may publish {subject}"
            assert ">" != subject and not subject.startswith(
                ("$JS.API.STREAM.DELETE", "$JS.API.STREAM.UPDATE", "$JS.API.STREAM.PURGE")
            ), f"{role}: {subject}"


def test_publisher_replicas_bucket_matches_the_publisher() -> None:
    from services.publisher import ownership

    assert nats_users_module().PUBLISHER_REPLICAS_BUCKET == ownership.REPLICAS_BUCKET.name
