"""`gpu-dra nats credentials` end to end: the Secrets it prints configure a real nats-server (the
shipped nats.conf including the generated users.conf), every identity's .creds file authenticates
through the Bus, the permissions baked into each user JWT hold, re-running keeps existing credentials
valid, and a rotated key is refused. The Ed25519 under the NKEYs is checked against RFC 8032."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import pytest
import yaml

from shared.bus import Bus, BusError, NatsTLS
from shared.cli import main as gpu_dra
from shared.events import catalog
from shared.events.inventory import NodeInventory
from shared.natsjwt import Creds, CredsError, decode_claims
from shared.nkeys import KeyPair, NKeyError, ed25519_public, ed25519_sign
from tests.deploy.conftest import NATS_DIR, ShippedConfigNats, server_env, start_gate

WAIT = 5.0


def test_ed25519_matches_rfc8032_vectors() -> None:
    vectors = [  # RFC 8032 section 7.1, tests 1 and 2: secret key, public key, message, signature
        (
            "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
            "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a",
            "",
            "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46b"
            "d25bf5f0595bbe24655141438e7a100b",
        ),
        (
            "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
            "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c",
            "72",
            "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d8c"
            "387b2eaeb4302aeeb00d291612bb0c00",
        ),
    ]
    for secret, public, message, signature in vectors:
        seed = bytes.fromhex(secret)
        assert ed25519_public(seed).hex() == public
        assert ed25519_sign(seed, bytes.fromhex(message)).hex() == signature


def test_nkey_texts_round_trip_and_damage_is_refused() -> None:
    for kind, letter in (("operator", "O"), ("account", "A"), ("user", "U")):
        key = KeyPair.create(kind)  # type: ignore[arg-type]
        assert key.public_key[0] == letter and len(key.public_key) == 56
        assert key.seed.startswith("S" + letter)
        assert KeyPair.from_seed(key.seed, kind).public_key == key.public_key  # type: ignore[arg-type]
    seed = KeyPair.create("user").seed
    damaged = seed[:10] + ("A" if seed[10] != "A" else "B") + seed[11:]
    with pytest.raises(NKeyError, match="checksum"):
        KeyPair.from_seed(damaged)
    with pytest.raises(NKeyError, match="expected a account seed"):
        KeyPair.from_seed(seed, "account")


def _run_credentials(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, str]]:
    assert gpu_dra(["nats", "credentials", *args]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert all(d["kind"] == "Secret" and d["metadata"]["namespace"] == "gpu-dra" for d in docs)
    return {d["metadata"]["name"]: d["stringData"] for d in docs}


class Deployment:
    """A nats-server on the shipped nats.conf with a generated users.conf; creds written to files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.server: ShippedConfigNats | None = None
        self.gate: Bus | None = None

    async def start(self, secrets: dict[str, dict[str, str]]) -> None:
        await self.close()
        (self.root / "config").mkdir(parents=True, exist_ok=True)
        (self.root / "auth").mkdir(exist_ok=True)
        shutil.copy(NATS_DIR / "nats.conf", self.root / "config" / "nats.conf")
        (self.root / "auth" / "users.conf").write_text(secrets["gpu-dra-nats-users"]["users.conf"])
        store = self.root / "js"
        self.server = ShippedConfigNats(
            self.root / "config" / "nats.conf", server_env("creds-test", store), store, gate=False
        )
        await self.server.start()
        self.gate = await start_gate(self.server.url, creds_file=self.creds(secrets, "gpu-dra-nats-gate", "user.creds"))

    async def close(self) -> None:
        if self.gate is not None:
            await self.gate.close()
            self.gate = None
        if self.server is not None:
            await self.server.close()
            self.server = None

    def creds(self, secrets: dict[str, dict[str, str]], secret: str, key: str) -> str:
        path = self.root / "creds" / secret / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets[secret][key])
        return str(path)

    async def bus(self, creds: str) -> Bus:
        assert self.server is not None
        return await Bus.connect(self.server.url, name="t", tls=NatsTLS(creds_file=creds), initial_attempts=1)


@pytest.fixture
async def deployment(tmp_path: Path) -> AsyncIterator[Deployment]:
    dep = Deployment(tmp_path / "deploy")
    try:
        yield dep
    finally:
        await dep.close()


async def _refused_login(deployment: Deployment, creds: str) -> None:
    """The server refuses a connect with these creds, and the Bus gives up within seconds naming the
    creds file (a service exits non-zero instead of retrying forever)."""
    assert deployment.server is not None
    user_jwt, signature = Creds(Path(creds).read_text()).callbacks()
    with pytest.raises(nats.errors.Error, match=r"(?i)authorization"):
        await nats.connect(
            deployment.server.url,
            user_jwt_cb=user_jwt,
            signature_cb=signature,
            allow_reconnect=False,
            connect_timeout=2,
        )
    async with asyncio.timeout(10):
        with pytest.raises(BusError, match=f"refused the login of creds file {re.escape(creds)}"):
            await Bus.connect(deployment.server.url, name="t", tls=NatsTLS(creds_file=creds))


async def _refused_publish(deployment: Deployment, creds: str, subject: str) -> None:
    """A plain nats-py client on the same .creds publishes `subject`; the server's refusal arrives."""
    assert deployment.server is not None
    errors: asyncio.Queue[str] = asyncio.Queue()

    async def on_error(exc: Exception) -> None:
        errors.put_nowait(str(exc))

    user_jwt, signature = Creds(Path(creds).read_text()).callbacks()
    nc = await nats.connect(
        deployment.server.url,
        user_jwt_cb=user_jwt,
        signature_cb=signature,
        error_cb=on_error,
        allow_reconnect=False,
        connect_timeout=2,
    )
    try:
        await nc.publish(subject, b"{}")
        await nc.flush()
        error = await asyncio.wait_for(errors.get(), WAIT)
        assert f'permissions violation for publish to "{subject}"'.lower() in error.lower()
    finally:
        await nc.close()


async def test_every_identity_authenticates_with_its_creds_and_its_permissions_hold(
    deployment: Deployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys"
    secrets = _run_credentials(
        ["--nodes", "gpu-a,gpu-b", "--reader", "billing=team-a", "--credentials-dir", str(keys)], capsys
    )
    assert set(secrets["gpu-dra-nats-node-gpu-a"]) == {"discovery.creds", "preparer.creds", "cd-agent.creds"}
    assert set(secrets) >= {
        "gpu-dra-nats-route",
        "gpu-dra-nats-publisher",
        "gpu-dra-nats-controller",
        "gpu-dra-nats-admin",
        "gpu-dra-nats-node-gpu-b",
        "gpu-dra-nats-reader-billing",
    }
    # the node's JWT carries its node's permissions and nothing of another node's
    claims = decode_claims(Creds(secrets["gpu-dra-nats-node-gpu-a"]["preparer.creds"]).jwt)
    assert claims["name"] == "preparer.gpu-a" and "_INBOX_preparer_gpu-a.>" in claims["nats"]["sub"]["allow"]
    assert not any("gpu-b" in s for s in claims["nats"]["pub"]["allow"] + claims["nats"]["sub"]["allow"])
    # the reader's JWT: its own durable, and a create of the dashboard's (every other reader's) name denied
    reader = decode_claims(Creds(secrets["gpu-dra-nats-reader-billing"]["user.creds"]).jwt)["nats"]["pub"]
    assert "$JS.API.CONSUMER.MSG.NEXT.DRA_EVENTS.reader_billing" in reader["allow"]
    assert reader["deny"] == ["$JS.API.CONSUMER.CREATE.DRA_EVENTS.reader_dashboard.>"]
    # the dashboard's JWT: consumers filtered inside every claim (its GPU-hours replay), no reader's durable
    dashboard = decode_claims(Creds(secrets["gpu-dra-nats-dashboard"]["user.creds"]).jwt)["nats"]["pub"]
    assert "$JS.API.CONSUMER.CREATE.DRA_EVENTS.*.dra.v1.claim.>" in dashboard["allow"]
    assert dashboard["deny"] == ["$JS.API.CONSUMER.CREATE.DRA_EVENTS.reader_billing.>"]
    await deployment.start(secrets)
    identities: list[tuple[str, str, str]] = [
        (f"gpu-dra-nats-{r}", "user.creds", r) for r in ("publisher", "controller", "admin")
    ]
    identities += [
        (f"gpu-dra-nats-node-{n}", f"{r}.creds", f"{r}_{n}")
        for n in ("gpu-a", "gpu-b")
        for r in ("discovery", "preparer", "cd-agent")
    ]
    identities.append(("gpu-dra-nats-reader-billing", "user.creds", "reader_billing"))
    for secret, key, identity in identities:
        bus = await deployment.bus(deployment.creds(secrets, secret, key))
        try:
            assert bus.identity == identity and bus.connected
        finally:
            await bus.close()
    # the service start path works under the JWT's permissions, and another node's subjects do not
    admin = await deployment.bus(deployment.creds(secrets, "gpu-dra-nats-admin", "user.creds"))
    discovery_creds = deployment.creds(secrets, "gpu-dra-nats-node-gpu-a", "discovery.creds")
    discovery = await deployment.bus(discovery_creds)
    publisher = await deployment.bus(deployment.creds(secrets, "gpu-dra-nats-publisher", "user.creds"))
    try:
        await admin.provision()
        await discovery.provision()
        inventory = NodeInventory(node="gpu-a", driver_version="550.163.1", cuda_driver_version="12.4.0")
        await (await discovery.kv(catalog.INVENTORY_BUCKET)).put("gpu-a", inventory)
        await discovery.publish(catalog.INVENTORY, inventory, msg_id="gpu-a-1", node="gpu-a")
        assert await (await publisher.kv(catalog.INVENTORY_BUCKET)).get("gpu-a") == inventory
        await _refused_publish(deployment, discovery_creds, catalog.INVENTORY.format(node="gpu-b"))
        await _refused_publish(deployment, discovery_creds, "dra.v1.deadletter.publisher.x")
    finally:
        for bus in (publisher, discovery, admin):
            await bus.close()


async def test_rerunning_keeps_credentials_and_a_rotated_key_is_refused(
    deployment: Deployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys"
    first = _run_credentials(["--nodes", "gpu-a", "--credentials-dir", str(keys)], capsys)
    old_creds = deployment.creds(first, "gpu-dra-nats-node-gpu-a", "preparer.creds")
    second = _run_credentials(["--nodes", "gpu-a,gpu-b", "--credentials-dir", str(keys)], capsys)
    await deployment.start(second)
    bus = await deployment.bus(old_creds)  # minted by the first run, still valid after adding a node
    await bus.close()
    rotated = _run_credentials(
        ["--nodes", "gpu-a,gpu-b", "--rotate", "preparer.gpu-a", "--credentials-dir", str(keys)], capsys
    )
    await deployment.start(rotated)
    await _refused_login(deployment, old_creds)
    new = await deployment.bus(deployment.creds(rotated, "gpu-dra-nats-node-gpu-a", "preparer.creds"))
    await new.close()
    other = await deployment.bus(deployment.creds(first, "gpu-dra-nats-node-gpu-a", "discovery.creds"))
    await other.close()  # only the rotated user changed


async def test_creds_of_another_deployment_are_refused(
    deployment: Deployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ours = _run_credentials(["--nodes", "gpu-a", "--credentials-dir", str(tmp_path / "ours")], capsys)
    theirs = _run_credentials(["--nodes", "gpu-a", "--credentials-dir", str(tmp_path / "theirs")], capsys)
    await deployment.start(ours)
    await _refused_login(deployment, deployment.creds(theirs, "gpu-dra-nats-node-gpu-a", "preparer.creds"))
    assert deployment.server is not None
    with pytest.raises((nats.errors.Error, OSError)):
        await nats.connect(deployment.server.url, allow_reconnect=False, connect_timeout=2)  # no credentials


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "gpu-a", "--reader", "billing"], "expected NAME=namespace"),
        (["--nodes", "gpu-a", "--reader", "billing=Team_A"], "not a Kubernetes namespace"),
        (["--nodes", "a.b"], "contains '.'"),
        (["--nodes", "gpu-a", "--rotate", "preparer.gpu-z"], "names no user"),
    ],
)
def test_bad_input_is_refused_with_exit_code_2(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu_dra(["nats", "credentials", *args, "--credentials-dir", str(tmp_path / "k")]) == 2
    assert message in capsys.readouterr().err


async def test_a_damaged_creds_file_stops_the_connect_with_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.creds"
    path.write_text("-----BEGIN NATS USER JWT-----\nnot-a-jwt\n------END NATS USER JWT------\n")
    with pytest.raises(BusError, match="not usable"):
        await Bus.connect("nats://127.0.0.1:1", name="t", tls=NatsTLS(creds_file=str(path)), initial_attempts=1)
    with pytest.raises(BusError, match="cannot read NATS credentials"):
        await Bus.connect(
            "nats://127.0.0.1:1", name="t", tls=NatsTLS(creds_file=str(tmp_path / "none")), initial_attempts=1
        )
    with pytest.raises(CredsError):
        Creds("nothing")


async def test_a_user_name_that_is_not_the_creds_user_is_refused_before_connecting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secrets = _run_credentials(["--nodes", "gpu-a", "--credentials-dir", str(tmp_path / "keys")], capsys)
    path = tmp_path / "preparer.creds"
    path.write_text(secrets["gpu-dra-nats-node-gpu-a"]["preparer.creds"])
    with pytest.raises(BusError, match=r"creds file is for 'preparer\.gpu-a'"):
        await Bus.connect(
            "nats://127.0.0.1:1",
            name="t",
            user="discovery.gpu-a",
            tls=NatsTLS(creds_file=str(path)),
            initial_attempts=1,
        )
