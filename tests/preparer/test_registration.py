"""Registration and the DRA services over real unix sockets, driven by the kubelet emulator."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from embedded.kubelet.client import PluginError, choose_version, register
from services.preparer.host.service import PreparerService
from services.preparer.host.sockets import SocketError
from services.preparer.protos import pluginregistration_v1_pb2 as reg_pb2
from services.preparer.protos import pluginregistration_v1_pb2_grpc as reg_grpc
from tests.preparer.helpers import node_config, running_node


async def test_registration_advertises_both_versions_and_the_dra_endpoint(claims, root: Path) -> None:
    async with running_node(claims, root) as node:
        reg = node.service.registration_socket
        assert reg == root / "reg" / "gpu.nvidia.com-reg.sock"
        async with grpc.aio.insecure_channel(f"unix:{reg}") as channel:
            info = await reg_grpc.RegistrationStub(channel).GetInfo(reg_pb2.InfoRequest(), timeout=1)
        assert info.type == "DRAPlugin"
        assert info.name == "gpu.nvidia.com"
        assert info.endpoint == str(root / "plugins" / "gpu.nvidia.com" / "dra.sock")
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        assert node.plugin.version == "v1"
        assert node.service.registration.registered.is_set()
        # an empty request is the health probe the reference sends: it must answer
        assert await node.plugin.prepare([]) == {}


async def test_a_kubelet_knowing_only_v1beta1_gets_v1beta1(claims, root: Path) -> None:
    async with running_node(claims, root) as node:
        old = await register(node.service.registration_socket, known={"v1beta1.DRAPlugin": "v1beta1"})
        try:
            assert old.version == "v1beta1"
            assert await old.unprepare([]) == {}
        finally:
            await old.close()


async def test_a_kubelet_knowing_no_listed_version_refuses_and_the_plugin_hears_it(claims, root: Path) -> None:
    async with running_node(claims, root) as node:
        with pytest.raises(PluginError, match="none of services supported by the plugin"):
            await register(node.service.registration_socket, known={"v1alpha3.NodeService": "v1alpha3"})
        assert not node.service.registration.registered.is_set()
        assert "none of services" in node.service.registration.last_error


def test_version_choice_follows_the_plugins_order() -> None:
    assert choose_version(["v1beta1.DRAPlugin", "v1.DRAPlugin"]) == "v1beta1"
    with pytest.raises(PluginError, match="no supported versions"):
        choose_version([])


async def test_restart_replaces_stale_sockets(claims, root: Path) -> None:
    cfg = node_config(root)
    first = PreparerService(cfg, claims)
    await first.start()
    dra = first.dra_socket
    # simulate a crash: the old sockets stay behind, nobody listens on them
    for server in (first._reg_server, first._dra_server):
        assert server is not None
        await server.stop(None)
    assert dra.exists()
    async with running_node(claims, root) as node:
        assert node.service.dra_socket == dra
        assert await node.plugin.prepare([]) == {}
        hidden = [p.name for p in (root / "reg").iterdir() if p.name.startswith(".")]
        assert hidden == []
    await first.stop()
    assert not dra.exists() and not (root / "reg" / "gpu.nvidia.com-reg.sock").exists()


async def test_a_non_socket_in_the_way_is_refused_and_left_alone(claims, root: Path) -> None:
    cfg = node_config(root)
    (root / "reg").mkdir()
    blocker = root / "reg" / "gpu.nvidia.com-reg.sock"
    blocker.write_text("not a socket")
    with pytest.raises(SocketError, match="is not a socket"):
        await PreparerService(cfg, claims).start()
    assert blocker.read_text() == "not a socket"


async def test_an_overlong_socket_path_is_refused(claims, root: Path) -> None:
    cfg = node_config(root)
    long_dir = root / ("x" * 120)
    cfg = type(cfg)(**{**{f: getattr(cfg, f) for f in cfg.__struct_fields__}, "plugins_dir": str(long_dir)})
    with pytest.raises(SocketError, match="at most 107"):
        await PreparerService(cfg, claims).start()
