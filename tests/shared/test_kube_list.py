"""The one paged LIST (shared.kube.rest.list_pages, and Kube.list over it) against the embedded API server:
every object once across pages, typed or as dicts, and the list's resourceVersion."""

from __future__ import annotations

from pathlib import Path

import msgspec

from embedded.apiserver.testing import running_apiserver
from shared.kube.resources import NODES, Kube
from shared.kube.rest import list_pages


class NodeName(msgspec.Struct):
    metadata: dict[str, str | dict[str, str]]


async def test_a_list_follows_continue_across_pages(tmp_path: Path) -> None:
    async with running_apiserver(tmp_path) as server, server.client() as api:
        kube = Kube(api)
        for i in range(5):
            await kube.create(NODES, None, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"n{i}"}})
        pages = [page async for page in list_pages(api, NODES.path(), NodeName, page_size=2)]
        assert [len(page.items) for page in pages] == [2, 2, 1]
        assert sorted(str(n.metadata["name"]) for page in pages for n in page.items) == [f"n{i}" for i in range(5)]
        nodes, version = await kube.list(NODES, page_size=2, transform=lambda n: {"name": n["metadata"]["name"]})
        assert sorted(n["name"] for n in nodes) == [f"n{i}" for i in range(5)]
        assert version == pages[0].metadata.resourceVersion and version.isdigit()
