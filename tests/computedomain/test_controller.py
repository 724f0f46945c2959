"""The controller against the embedded API server and a real nats-server, with real agents."""

from __future__ import annotations

import asyncio
import os

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from embedded.apiserver.testing import running_apiserver
from services.computedomain import crd
from services.computedomain.channelcore import ChannelClaim, ChannelConflict, parse_channel_config
from services.computedomain.controller import Controller
from services.computedomain.membership import Membership
from shared.bus import Bus
from tests.computedomain.helpers import install_crds, running_nodes, wait_for_object

GB200_1 = "gb200x4:clique=1"
GB200_2 = "gb200x4:clique=2"


@pytest.fixture
async def world(nats_server, tmp_path):
    bus = await Bus.connect(nats_server.url, name="test")
    await bus.provision()
    async with running_apiserver(tmp_path) as api, api.client() as kube:
        await install_crds(kube)
        try:
            yield bus, kube
        finally:
            await bus.close()


def cd_body(name: str, template: str, **spec) -> dict:
    return {
        "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
        "kind": crd.KIND,
        "metadata": {"name": name},
        "spec": {"channel": {"resourceClaimTemplate": {"name": template}}, **spec},
    }


async def wait_cd(custom, name, predicate, timeout=15.0):
    return await wait_for_object(custom, crd.GROUP, crd.VERSION, "ns", crd.PLURAL, name, predicate, timeout)


async def test_domain_lifecycle_template_status_and_cleanup(world, tmp_path):
    bus, kube = world
    custom = client.CustomObjectsApi(kube)
    stopping = asyncio.Event()
    controller = Controller(kube, bus, deletion_timeout=5.0)
    run = asyncio.create_task(controller.run(stopping))
    try:
        created = await custom.create_namespaced_custom_object(
            crd.GROUP, crd.VERSION, "ns", crd.PLURAL, cd_body("train", "train-channel")
        )
        uid = created["metadata"]["uid"]
        # finalizer, and an empty domain reports Ready as upstream does
        cd = await wait_cd(
            custom,
            "train",
            lambda o: (
                o
                and crd.FINALIZER in o["metadata"].get("finalizers", [])
                and (o.get("status") or {}).get("status") == "Ready"
            ),
        )
        rct = await custom.get_namespaced_custom_object(
            "resource.k8s.io", "v1", "ns", "resourceclaimtemplates", "train-channel"
        )
        devices = rct["spec"]["spec"]["devices"]
        assert devices["requests"] == [
            {
                "name": "channel",
                "exactly": {"deviceClassName": "compute-domain-default-channel.nvidia.com", **_defaults(devices)},
            }
        ]
        params = devices["config"][0]["opaque"]
        assert params["driver"] == "compute-domain.nvidia.com"
        assert params["parameters"] == {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomainChannelConfig",
            "domainID": uid,
            "allocationMode": "Single",
        }
        assert rct["metadata"]["labels"][crd.LABEL_DOMAIN] == uid

        # four nodes in two cliques join through the channel preparer core
        async with running_nodes(bus, tmp_path, [GB200_1, GB200_1, GB200_2, GB200_2]) as nodes:
            cfg = parse_channel_config(params["parameters"])
            await asyncio.gather(
                *(n.channels.prepare(ChannelClaim(f"c{i}", "ns", f"c{i}", cfg)) for i, n in enumerate(nodes))
            )
            cd = await wait_cd(
                custom,
                "train",
                lambda o: (
                    o
                    and len((o.get("status") or {}).get("nodes", [])) == 4
                    and o["status"]["status"] == "Ready"
                    and all(n["status"] == "Ready" for n in o["status"]["nodes"])
                ),
            )
            by_clique: dict[str, list[int]] = {}
            for n in cd["status"]["nodes"]:
                by_clique.setdefault(n["cliqueID"], []).append(n["index"])
            assert sorted(sorted(v) for v in by_clique.values()) == [[0, 1], [0, 1]]
            assert all(c.endswith((".1", ".2")) for c in by_clique)

            # a second domain on a busy node: refused, the first stays Ready
            other = await custom.create_namespaced_custom_object(
                crd.GROUP, crd.VERSION, "ns", crd.PLURAL, cd_body("other", "other-channel")
            )
            await wait_cd(custom, "other", lambda o: o and (o.get("status") or {}).get("status") == "Ready")
            other_cfg = parse_channel_config({**params["parameters"], "domainID": other["metadata"]["uid"]})
            with pytest.raises(ChannelConflict, match="already serves ComputeDomain ns/train"):
                await nodes[0].channels.prepare(ChannelClaim("o0", "ns", "o0", other_cfg))
            written = controller.domains[uid].written
            assert written is not None and written["status"] == "Ready"

            # deleting the domain stops every daemon, empties KV, removes the template and the CR
            pids = [n.daemon.pid for n in nodes]
            await custom.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, "ns", crd.PLURAL, "train")
            await wait_cd(custom, "train", lambda o: o is None)
            assert all(n.agent.domain is None for n in nodes)
            for pid in pids:
                assert pid is not None
                with pytest.raises(ProcessLookupError):
                    os.kill(pid, 0)
            assert await Membership(bus).members(uid) == {}
            with pytest.raises(ApiException) as gone:
                await custom.get_namespaced_custom_object(
                    "resource.k8s.io", "v1", "ns", "resourceclaimtemplates", "train-channel"
                )
            assert gone.value.status == 404
            await custom.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, "ns", crd.PLURAL, "other")
            await wait_cd(custom, "other", lambda o: o is None)
    finally:
        stopping.set()
        await run


def _defaults(devices: dict) -> dict:
    """Fields the API server defaults in a v1 exact request (allocationMode, count), kept as served."""
    exact = devices["requests"][0]["exactly"]
    return {k: v for k, v in exact.items() if k != "deviceClassName"}


async def test_standby_controller_takes_over_and_keeps_status_current(world, tmp_path):
    from services.computedomain.leader import LeaderElector

    bus, kube = world
    custom = client.CustomObjectsApi(kube)

    def candidate(name: str):
        elector = LeaderElector(
            kube,
            namespace="default",
            name="cd-ctl",
            identity=name,
            lease_duration=2.0,
            renew_deadline=1.5,
            retry_period=0.2,
        )
        stopping = asyncio.Event()

        async def lead(lost: asyncio.Event) -> None:
            await Controller(kube, bus, deletion_timeout=5.0).run(lost)

        return elector, stopping, asyncio.create_task(elector.run(stopping, lead))

    first, first_stop, first_task = candidate("one")
    await asyncio.wait_for(first.leading.wait(), 5)
    second, second_stop, second_task = candidate("two")
    try:
        await custom.create_namespaced_custom_object(
            crd.GROUP, crd.VERSION, "ns", crd.PLURAL, cd_body("fo", "fo-channel", numNodes=2)
        )
        cd = await wait_cd(custom, "fo", lambda o: o and (o.get("status") or {}).get("status") == "NotReady")
        cfg = parse_channel_config(
            {
                "apiVersion": "resource.nvidia.com/v1beta1",
                "kind": "ComputeDomainChannelConfig",
                "domainID": cd["metadata"]["uid"],
            }
        )
        async with running_nodes(bus, tmp_path, [GB200_1, GB200_1]) as nodes:
            await nodes[0].channels.prepare(ChannelClaim("f0", "ns", "f0", cfg))
            await wait_cd(custom, "fo", lambda o: o and len(o["status"].get("nodes", [])) == 1)
            first_task.cancel()  # the leader dies: no renewals, no release
            await asyncio.wait_for(second.leading.wait(), 5)
            # the new leader rebuilt its view from KV and the CRs, and follows new members
            await nodes[1].channels.prepare(ChannelClaim("f1", "ns", "f1", cfg))
            cd = await wait_cd(
                custom, "fo", lambda o: o and o["status"]["status"] == "Ready" and len(o["status"]["nodes"]) == 2
            )
            assert sorted(n["index"] for n in cd["status"]["nodes"]) == [0, 1]
            await nodes[1].channels.unprepare("f1", cd["metadata"]["uid"])
            cd = await wait_cd(custom, "fo", lambda o: o and len(o["status"]["nodes"]) == 1)
            assert cd["status"]["status"] == "NotReady"  # numNodes 2 not met
            # the status changes are Events on the domain (its first NotReady is no news)
            listed = await client.CoreV1Api(kube).list_namespaced_event("ns")
            seen = [
                (e.reason, e.type, e.message)
                for e in sorted(listed.items, key=lambda e: int(e.metadata.resource_version))
                if e.involved_object.kind == crd.KIND and e.involved_object.name == "fo"
            ]
            assert seen == [
                ("ComputeDomainReady", "Normal", "status Ready: 2 of 2 nodes Ready"),
                ("ComputeDomainNotReady", "Warning", "status NotReady: 1 of 2 nodes Ready"),
            ]
    finally:
        second_stop.set()
        await second_task
        first_stop.set()


async def test_member_changes_cost_no_template_create_and_a_deleted_template_comes_back(nats_server, tmp_path):
    bus = await Bus.connect(nats_server.url, name="test")
    await bus.provision()
    async with running_apiserver(tmp_path) as api, api.client() as kube:
        await install_crds(kube)
        custom = client.CustomObjectsApi(kube)
        stopping = asyncio.Event()
        controller = Controller(kube, bus, deletion_timeout=5.0)
        run = asyncio.create_task(controller.run(stopping))

        def creates() -> int:
            return api.server.requests.counts[("CREATE", "resource.k8s.io", "resourceclaimtemplates", "")]

        try:
            created = await custom.create_namespaced_custom_object(
                crd.GROUP, crd.VERSION, "ns", crd.PLURAL, cd_body("tpl", "tpl-channel")
            )
            await wait_cd(custom, "tpl", lambda o: o and crd.FINALIZER in o["metadata"].get("finalizers", []))
            await wait_for_object(custom, "resource.k8s.io", "v1", "ns", "resourceclaimtemplates", "tpl-channel", bool)
            before, writes = creates(), controller.writes
            cfg = parse_channel_config(
                {
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "ComputeDomainChannelConfig",
                    "domainID": created["metadata"]["uid"],
                    "allocationMode": "Single",
                }
            )
            async with running_nodes(bus, tmp_path, [GB200_1, GB200_1]) as nodes:
                await asyncio.gather(
                    *(n.channels.prepare(ChannelClaim(f"t{i}", "ns", f"t{i}", cfg)) for i, n in enumerate(nodes))
                )
                await wait_cd(
                    custom,
                    "tpl",
                    lambda o: o and [n["status"] for n in (o.get("status") or {}).get("nodes", [])] == ["Ready"] * 2,
                )
            # members joined and turned Ready: statuses written, the template not created again (nor refused 409)
            assert controller.writes > writes
            assert creates() == before

            # a template deleted by hand comes back: its deletion, seen by the controller, syncs the domain
            await custom.delete_namespaced_custom_object(
                "resource.k8s.io", "v1", "ns", "resourceclaimtemplates", "tpl-channel"
            )
            back = await wait_for_object(
                custom, "resource.k8s.io", "v1", "ns", "resourceclaimtemplates", "tpl-channel", bool
            )
            assert back["metadata"]["labels"][crd.LABEL_DOMAIN] == created["metadata"]["uid"]
            assert creates() == before + 1
        finally:
            stopping.set()
            await run
            await bus.close()
