"""The pods/{name}/log subresource: a container's output, read from the log files the node's kubelet writes.

Owns finding the file (`<pod-log-dir>/<namespace>_<pod>_<uid>/<container>/<restart>.log`, the current run or,
with `previous`, the one before), the kubelet's query parameters (container, follow, previous, tailLines,
timestamps, limitBytes) and the errors kubectl shows (container name needed, waiting to start, no previous run).
Each line in a file is `<RFC 3339 timestamp> <text>`; the timestamp is shown only with `timestamps=true`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web

from embedded.apiserver import errors
from embedded.apiserver.queryparams import query_int, truthy

FOLLOW_POLL = 0.2


def _runs(directory: Path) -> list[Path]:
    """The container's log files, oldest run first."""
    try:
        files = [p for p in directory.iterdir() if p.suffix == ".log" and p.stem.isdigit()]
    except OSError:
        return []
    return sorted(files, key=lambda p: int(p.stem))


def _container(pod: dict[str, Any], wanted: str) -> str:
    spec = pod.get("spec") or {}
    names = [c["name"] for c in spec.get("containers") or []]
    inits = [c["name"] for c in spec.get("initContainers") or []]
    ephemerals = [c["name"] for c in spec.get("ephemeralContainers") or []]
    name = pod["metadata"]["name"]
    if not wanted:
        if len(names) == 1:
            return str(names[0])
        raise errors.bad_request(
            f"a container name must be specified for pod {name}, choose one of: "
            f"[{' '.join(names)}] or one of the init containers: [{' '.join(inits)}]"
        )
    if wanted not in names + inits + ephemerals:
        raise errors.bad_request(f"container {wanted} is not valid for pod {name}")
    return wanted


def _state(pod: dict[str, Any], container: str) -> dict[str, Any]:
    status = pod.get("status") or {}
    for c in [
        *(status.get("containerStatuses") or []),
        *(status.get("initContainerStatuses") or []),
        *(status.get("ephemeralContainerStatuses") or []),
    ]:
        if c.get("name") == container:
            return {k: v for k, v in (c.get("state") or {}).items() if v}
    return {}


def _format(raw: bytes, timestamps: bool) -> bytes:
    if timestamps:
        return raw
    out = []
    for line in raw.splitlines(keepends=True):
        _, _, text = line.partition(b" ")
        out.append(text)
    return b"".join(out)


def _read(path: Path, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    cut = data.rfind(b"\n") + 1  # whole lines only; the rest comes with the next read
    return data[:cut]


def handler(server: Any) -> Any:
    """The GET handler for /api/v1/namespaces/{namespace}/pods/{name}/log."""

    async def pod_log(request: web.Request) -> web.StreamResponse:
        ns, name = request.match_info["namespace"], request.match_info["name"]
        res = server.registry.get("", "v1", "pods")
        pod = server.core.get(res, ns, name)
        q = request.query
        container = _container(pod, q.get("container", ""))
        root: Path | None = getattr(server, "pod_log_dir", None)
        runs = _runs(root / f"{ns}_{name}_{pod['metadata']['uid']}" / container) if root else []
        tail, limit_bytes = query_int(q, "tailLines"), query_int(q, "limitBytes")

        def flag(key: str) -> bool:
            return truthy(q.get(key))

        if flag("previous"):
            if len(runs) < 2:
                raise errors.bad_request(f'previous terminated container "{container}" in pod "{name}" not found')
            path = runs[-2]
        elif runs:
            path = runs[-1]
        else:
            waiting = (_state(pod, container).get("waiting") or {}).get("reason", "ContainerCreating")
            raise errors.bad_request(f'container "{container}" in pod "{name}" is waiting to start: {waiting}')
        timestamps = flag("timestamps")
        data = await asyncio.to_thread(_read, path, 0)
        offset = len(data)
        if tail is not None and tail >= 0:  # a negative count is ignored: the whole log
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-tail:] if tail else [])
        body = _format(data, timestamps)
        if limit_bytes is not None and limit_bytes >= 0:
            body = body[:limit_bytes]
        if not flag("follow"):
            return web.Response(body=body, content_type="text/plain")
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(body)
        while True:
            more = await asyncio.to_thread(_read, path, offset)
            offset += len(more)
            if more:
                await response.write(_format(more, timestamps))
                continue
            try:
                current = server.core.get(res, ns, name)
            except errors.ApiError:
                break  # the pod is gone
            if (
                current["metadata"]["uid"] != pod["metadata"]["uid"]
                or "running" not in _state(current, container)
                or _runs(path.parent)[-1] != path
            ):
                more = await asyncio.to_thread(_read, path, offset)  # what it wrote before it ended
                if more:
                    await response.write(_format(more, timestamps))
                break
            await asyncio.sleep(FOLLOW_POLL)
        await response.write_eof()
        return response

    return pod_log
