"""pods/{name}/log: served from the kubelets' log files, with kubectl's options and its error messages."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes_asyncio import client

from embedded.apiserver.testing import running_apiserver

pytestmark = pytest.mark.asyncio


async def test_log_subresource_reads_the_node_files(tmp_path: Path) -> None:
    async with running_apiserver(tmp_path / "api") as api:
        api.server.pod_log_dir = tmp_path / "logs"
        async with api.client() as c:
            core = client.CoreV1Api(c)
            pod = await core.create_namespaced_pod(
                "default",
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": "p"},
                    "spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "x"}]},
                },
            )
            with pytest.raises(client.ApiException) as exc:
                await core.read_namespaced_pod_log("p", "default")
            # str(): the client decodes an error body to str, its stubs say bytes
            assert exc.value.status == 400 and "a container name must be specified for pod p" in str(exc.value.body)
            with pytest.raises(client.ApiException) as exc:
                await core.read_namespaced_pod_log("p", "default", container="a")
            assert "is waiting to start: ContainerCreating" in str(exc.value.body)
            d = tmp_path / "logs" / f"default_p_{pod.metadata.uid}" / "a"
            d.mkdir(parents=True)
            (d / "0.log").write_text("2026-01-01T00:00:00.000001Z one\n")
            (d / "1.log").write_text("2026-01-01T00:00:01.000001Z two\n2026-01-01T00:00:02.000001Z three\npart")
            assert await core.read_namespaced_pod_log("p", "default", container="a") == "two\nthree\n"
            assert await core.read_namespaced_pod_log("p", "default", container="a", previous=True) == "one\n"
            assert (
                await core.read_namespaced_pod_log("p", "default", container="a", tail_lines=1, timestamps=True)
                == "2026-01-01T00:00:02.000001Z three\n"
            )
            with pytest.raises(client.ApiException) as exc:  # an integer as Go's ParseInt reads one, or a 400
                await core.read_namespaced_pod_log("p", "default", container="a", tail_lines="1_0")
            assert exc.value.status == 400 and "query parameter tailLines" in str(exc.value.body)
            with pytest.raises(client.ApiException) as exc:
                await core.read_namespaced_pod_log("p", "default", container="nope")
            assert "container nope is not valid for pod p" in str(exc.value.body)
            with pytest.raises(client.ApiException) as exc:
                await core.read_namespaced_pod_log("q", "default")
            assert exc.value.status == 404
