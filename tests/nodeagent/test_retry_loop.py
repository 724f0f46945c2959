"""The kubelet emulator's retry loop outlives an API server that goes away mid-round (found by bench/chaos.py:
a pod's final delete hit a killed API server, the error ended the retry task, and pods waiting for a
driver that had just registered again stayed ContainerCreating for good)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from kubernetes_asyncio import client

from embedded.apiserver.testing import running_apiserver
from embedded.cluster import identities
from embedded.nodeagent.plugins import PluginRegistry
from embedded.nodeagent.pods import PodRunner
from shared.kube.client import kube_api_client
from shared.ports import free_port


def unreachable_api() -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = f"https://127.0.0.1:{free_port()}"  # nothing listens there: connection refused
    cfg.verify_ssl = False
    return client.ApiClient(cfg)


def deleted_pod(uid: str) -> dict:
    return {
        "metadata": {"name": "p", "namespace": "default", "uid": uid, "deletionTimestamp": "2026-12-04T00:00:00Z"},
        "spec": {},
        "status": {},
    }


async def test_a_final_delete_that_cannot_reach_the_api_server_is_retried_not_raised(tmp_path: Path) -> None:
    api = unreachable_api()
    try:
        runner = PodRunner("n", api, PluginRegistry(tmp_path / "reg"), [], state_dir=tmp_path / "state")
        await runner.sync_pod(deleted_pod("u1"))
        assert runner._retry == {"u1"}, "the retry loop deletes it once the API server is back"
    finally:
        await api.close()


@contextlib.asynccontextmanager
async def _loop_past_a_failed_round(
    tmp_path: Path, failure: BaseException, stopping: asyncio.Event
) -> AsyncIterator[asyncio.Task[None]]:
    """A retry loop whose first round raises `failure`; yields the loop's task once a second round ran."""
    api = unreachable_api()
    runner = PodRunner("n", api, PluginRegistry(tmp_path / "reg"), [], state_dir=tmp_path / "state")
    runner._retry.add("u1")
    rounds: list[int] = []
    second = asyncio.Event()

    async def retry_pending() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise failure
        second.set()

    runner.retry_pending = retry_pending  # type: ignore[method-assign]
    loop = asyncio.create_task(runner._retry_loop(stopping, None))
    try:
        await asyncio.wait_for(second.wait(), 5)
        assert not loop.done(), "the loop ended after its failed round"
        yield loop
    finally:
        await api.close()


async def test_the_retry_loop_keeps_going_after_a_round_fails(tmp_path: Path) -> None:
    stopping = asyncio.Event()
    async with _loop_past_a_failed_round(
        tmp_path, RuntimeError("a round that fails as nobody foresaw"), stopping
    ) as loop:
        stopping.set()
        await asyncio.wait_for(loop, 5)


async def test_the_retry_loop_outlives_a_cancelled_error_it_did_not_ask_for(tmp_path: Path) -> None:
    """A callee's CancelledError (Python's gRPC raises one when the channel is closed under a call) is a failed
    round, not the loop's end; the loop still stops when it is cancelled itself."""
    async with _loop_past_a_failed_round(tmp_path, asyncio.CancelledError(), asyncio.Event()) as loop:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(loop, 5)
        assert loop.cancelled()


async def test_a_waiting_pod_that_is_gone_is_forgotten_under_the_node_authorizer(tmp_path: Path) -> None:
    """Under the Node authorizer a kubelet's GET of a pod that is no longer bound to it (here: deleted) is a
    403, not a 404, as on a real cluster: the emulator forgets the pod instead of retrying it forever."""
    tokens = identities.kubelet_tokens(["n"])
    token_file = identities.write_secret(tmp_path / "tokens.csv", identities.token_file_text(tokens))
    async with running_apiserver(tmp_path, token_file=token_file) as server:
        async with server.client() as admin:
            core = client.CoreV1Api(admin)
            await core.create_namespace({"metadata": {"name": "gpu-dra"}})  # type: ignore[arg-type]
            await identities.install(admin)
            created = await core.create_namespaced_pod(
                "default",
                {  # type: ignore[arg-type]
                    "metadata": {"name": "p"},
                    "spec": {
                        "nodeName": "n",
                        "containers": [{"name": "c", "image": "x:1"}],
                        "resourceClaims": [{"name": "gpu", "resourceClaimName": "not-yet"}],
                    },
                },
            )
            pod = admin.sanitize_for_serialization(created)
        config = await identities.write_kubeconfig(server.kubeconfig_path, tokens["n"], tmp_path / "kubelet.json")
        async with await kube_api_client(str(config)) as api:
            runner = PodRunner("n", api, PluginRegistry(tmp_path / "reg"), [], state_dir=tmp_path / "state")
            runner.pods[pod["metadata"]["uid"]] = pod
            runner._retry.add(pod["metadata"]["uid"])
            await runner.retry_pending()  # bound to it: read, and kept waiting for its claim
            assert runner._retry == {pod["metadata"]["uid"]}
            async with server.client() as admin:
                await client.CoreV1Api(admin).delete_namespaced_pod("p", "default", grace_period_seconds=0)
            await runner.retry_pending()
            assert runner._retry == set() and runner.pods == {}
