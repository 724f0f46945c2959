"""client-go's protobuf against the embedded API server: bodies sent, responses, lists and watch
frames read back, all with messages from tests/apiserver/fixtures/k8s_subset.proto (upstream's
field numbers, compiled here with grpcio-tools' protoc): an encoder independent of the server's
codec. Custom resources stay JSON (415 / 406 / JSON for `protobuf, */*`) as upstream."""

from __future__ import annotations

import datetime as dt
import importlib.util
import struct
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import msgspec
import pytest
import pytest_asyncio
import yaml
from google.protobuf.message import Message

from embedded.apiserver.testing import RunningApiServer, running_apiserver

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

FIXTURES = Path(__file__).parent / "fixtures"
PROTO = "application/vnd.kubernetes.protobuf"
CLIENT_GO_ACCEPT = "application/vnd.kubernetes.protobuf, */*"
MAGIC = b"k8s\x00"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def _compile(tmp: Path) -> ModuleType:
    from grpc_tools import protoc

    rc = protoc.main(["protoc", f"-I{FIXTURES}", f"--python_out={tmp}", str(FIXTURES / "k8s_subset.proto")])
    assert rc == 0, "protoc could not compile k8s_subset.proto"
    spec = importlib.util.spec_from_file_location("k8s_subset_pb2", tmp / "k8s_subset_pb2.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["k8s_subset_pb2"] = module
    spec.loader.exec_module(module)
    return module


# ---- JSON <-> message, written against the descriptors (not the server's table)


def build(cls: Any, obj: dict[str, Any]) -> Any:
    msg = cls()
    _fill(msg, obj)
    return msg


def _fill(msg: Message, obj: dict[str, Any]) -> None:
    for name, value in obj.items():
        field = msg.DESCRIPTOR.fields_by_name[name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            for k, v in value.items():
                if value_field.message_type is None:
                    getattr(msg, name)[k] = v
                else:
                    _set_message(getattr(msg, name)[k], v)
        elif field.is_repeated:
            for item in value:
                if field.message_type is None:
                    getattr(msg, name).append(item)
                else:
                    _set_message(getattr(msg, name).add(), item)
        elif field.message_type is not None:
            _set_message(getattr(msg, name), value)
        else:
            setattr(msg, name, value)


def _set_message(msg: Message, value: Any) -> None:
    kind = msg.DESCRIPTOR.name
    if kind == "Quantity":
        msg.string = value  # type: ignore[attr-defined]
    elif kind in ("Time", "MicroTime"):
        when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        msg.seconds = int(when.timestamp())  # type: ignore[attr-defined]
        msg.nanos = when.microsecond * 1000  # type: ignore[attr-defined]
    else:
        _fill(msg, value)


def as_json(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field, value in msg.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {
                k: (v if value_field.message_type is None else _message_json(v)) for k, v in value.items()
            }
        elif field.is_repeated:
            out[field.name] = [_message_json(v) if field.message_type else v for v in value]
        elif field.message_type is not None:
            out[field.name] = _message_json(value)
        else:
            out[field.name] = value
    return out


def _message_json(msg: Message) -> Any:
    kind = msg.DESCRIPTOR.name
    if kind == "Quantity":
        return msg.string  # type: ignore[attr-defined]
    if kind in ("Time", "MicroTime"):
        when = dt.datetime.fromtimestamp(msg.seconds, dt.UTC) + dt.timedelta(microseconds=msg.nanos // 1000)  # type: ignore[attr-defined]
        return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if kind == "MicroTime" else "%Y-%m-%dT%H:%M:%SZ")
    return as_json(msg)


def wrap(pb: ModuleType, api_version: str, kind: str, msg: Message) -> bytes:
    unknown = pb.Unknown(typeMeta=pb.TypeMeta(apiVersion=api_version, kind=kind), raw=msg.SerializeToString())
    return MAGIC + unknown.SerializeToString()


def unwrap(pb: ModuleType, body: bytes) -> tuple[tuple[str, str], bytes]:
    assert body.startswith(MAGIC), body[:40]
    unknown = pb.Unknown.FromString(body[len(MAGIC) :])
    return (unknown.typeMeta.apiVersion, unknown.typeMeta.kind), unknown.raw


def subset(small: Any, big: Any) -> bool:
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and subset(v, big[k]) for k, v in small.items())
    if isinstance(small, list):
        return isinstance(big, list) and len(small) == len(big) and all(map(subset, small, big))
    return bool(small == big)


# ---- one server for the module


class Client:
    def __init__(self, api: RunningApiServer, session: aiohttp.ClientSession, pb: ModuleType) -> None:
        self.api, self.session, self.pb = api, session, pb

    async def __call__(
        self, method: str, path: str, body: bytes | dict[str, Any] | None = None, accept: str = CLIENT_GO_ACCEPT
    ) -> tuple[int, str, bytes]:
        headers = {"Authorization": f"Bearer {self.api.token}", "Accept": accept}
        data = None
        if isinstance(body, bytes):
            headers["Content-Type"], data = PROTO, body
        elif body is not None:
            headers["Content-Type"], data = "application/json", msgspec.json.encode(body)
        async with self.session.request(method, self.api.url + path, data=data, headers=headers, ssl=False) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), await resp.read()

    async def json(self, path: str) -> Any:
        status, _, body = await self("GET", path, accept="application/json")
        assert status == 200, body
        return msgspec.json.decode(body)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def k8s(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Client]:
    tmp = tmp_path_factory.mktemp("protobuf")
    pb = _compile(tmp)
    async with running_apiserver(tmp) as api, aiohttp.ClientSession() as session:
        yield Client(api, session, pb)


SLICE_SPEC: dict[str, Any] = {
    "driver": "gpu.nvidia.com",
    "nodeName": "node-a",
    "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
    "devices": [
        {
            "name": "gpu-0",
            "attributes": {
                "uuid": {"string": "GPU-0"},
                "index": {"int": 0},
                "driverVersion": {"version": "1.2.3"},
                "mig": {"bool": False},
            },
            "capacity": {"memory": {"value": "80Gi"}},
        }
    ],
}


async def test_resourceslice_create_get_update_list_delete(k8s: Client) -> None:
    pb = k8s.pb
    meta = {"name": "s1", "labels": {"node": "node-a"}, "notUpstream": "dropped"}
    body = wrap(
        pb, "resource.k8s.io/v1", "ResourceSlice", build(pb.ResourceSlice, {"metadata": meta, "spec": SLICE_SPEC})
    )
    status, ctype, raw = await k8s("POST", SLICES, body)
    assert status == 201 and ctype == PROTO, raw
    type_meta, message = unwrap(pb, raw)
    assert type_meta == ("resource.k8s.io/v1", "ResourceSlice")
    created = as_json(pb.ResourceSlice.FromString(message))
    assert created["spec"] == SLICE_SPEC and created["metadata"]["labels"] == {"node": "node-a"}

    stored = await k8s.json(f"{SLICES}/s1")  # the JSON form is the intended object
    assert stored["spec"] == SLICE_SPEC and stored["metadata"]["labels"] == {"node": "node-a"}
    assert "notUpstream" not in stored["metadata"]
    status, _, raw = await k8s("GET", f"{SLICES}/s1")
    assert status == 200
    got = as_json(pb.ResourceSlice.FromString(unwrap(pb, raw)[1]))
    assert got["spec"] == stored["spec"]
    assert {k: got["metadata"][k] for k in ("name", "uid", "resourceVersion", "creationTimestamp", "labels")} == {
        k: stored["metadata"][k] for k in ("name", "uid", "resourceVersion", "creationTimestamp", "labels")
    }

    changed = {**SLICE_SPEC, "pool": {**SLICE_SPEC["pool"], "generation": 2}}
    update = build(
        pb.ResourceSlice,
        {"metadata": {"name": "s1", "resourceVersion": stored["metadata"]["resourceVersion"]}, "spec": changed},
    )
    status, _, raw = await k8s("PUT", f"{SLICES}/s1", wrap(pb, "resource.k8s.io/v1", "ResourceSlice", update))
    assert status == 200, raw
    assert (await k8s.json(f"{SLICES}/s1"))["spec"]["pool"]["generation"] == 2
    stale = await k8s("PUT", f"{SLICES}/s1", wrap(pb, "resource.k8s.io/v1", "ResourceSlice", update))
    assert stale[0] == 409
    conflict = pb.Status.FromString(unwrap(pb, stale[2])[1])  # errors come back as a protobuf Status
    assert (conflict.code, conflict.reason, conflict.status) == (409, "Conflict", "Failure")

    await k8s(
        "POST",
        SLICES,
        wrap(
            pb,
            "resource.k8s.io/v1",
            "ResourceSlice",
            build(pb.ResourceSlice, {"metadata": {"name": "s2"}, "spec": SLICE_SPEC}),
        ),
    )
    status, _, raw = await k8s("GET", SLICES)
    type_meta, message = unwrap(pb, raw)
    listed = pb.ResourceSliceList.FromString(message)
    assert type_meta == ("resource.k8s.io/v1", "ResourceSliceList")
    assert [i.metadata.name for i in listed.items] == ["s1", "s2"] and int(listed.metadata.resourceVersion) > 0
    assert [as_json(i)["spec"] for i in listed.items] == [changed, SLICE_SPEC]

    metadata_accept = (
        "application/vnd.kubernetes.protobuf;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,"
        "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
    )
    status, _, raw = await k8s("GET", SLICES, accept=metadata_accept)  # client-go's metadata client
    type_meta, message = unwrap(pb, raw)
    assert type_meta == ("meta.k8s.io/v1", "PartialObjectMetadataList")
    assert [i.metadata.name for i in pb.PartialObjectMetadataList.FromString(message).items] == ["s1", "s2"]
    status, ctype, raw = await k8s("GET", SLICES, accept="application/json;as=Table;v=v1;g=meta.k8s.io")
    assert status == 200 and ctype == "application/json" and msgspec.json.decode(raw)["kind"] == "Table"

    options = wrap(pb, "resource.k8s.io/v1", "DeleteOptions", pb.DeleteOptions(gracePeriodSeconds=0))
    status, _, raw = await k8s("DELETE", f"{SLICES}/s2", options)
    assert status == 200 and unwrap(pb, raw)[0] == ("resource.k8s.io/v1", "ResourceSlice")
    assert (await k8s("GET", f"{SLICES}/s2"))[0] == 404


async def _frames(resp: aiohttp.ClientResponse, count: int) -> list[bytes]:
    out = []
    for _ in range(count):
        (length,) = struct.unpack(">I", await resp.content.readexactly(4))
        out.append(await resp.content.readexactly(length))
    return out


async def test_watch_streams_length_prefixed_watch_events(k8s: Client) -> None:
    pb = k8s.pb
    rv = (await k8s.json(SLICES))["metadata"]["resourceVersion"]
    headers = {"Authorization": f"Bearer {k8s.api.token}", "Accept": CLIENT_GO_ACCEPT}
    url = f"{k8s.api.url}{SLICES}?watch=true&resourceVersion={rv}&fieldSelector=metadata.name%3Dw1"
    async with k8s.session.get(url, headers=headers, ssl=False) as resp:
        assert resp.headers["Content-Type"] == "application/vnd.kubernetes.protobuf;stream=watch"
        made = build(pb.ResourceSlice, {"metadata": {"name": "w1"}, "spec": SLICE_SPEC})
        assert (await k8s("POST", SLICES, wrap(pb, "resource.k8s.io/v1", "ResourceSlice", made)))[0] == 201
        current = await k8s.json(f"{SLICES}/w1")
        current["metadata"]["labels"] = {"x": "y"}
        status, _, _ = await k8s("PUT", f"{SLICES}/w1", current)
        assert status == 200
        assert (await k8s("DELETE", f"{SLICES}/w1"))[0] == 200
        events = [pb.WatchEvent.FromString(f) for f in await _frames(resp, 3)]
    assert [e.type for e in events] == ["ADDED", "MODIFIED", "DELETED"]
    objects = [unwrap(pb, e.object.raw) for e in events]  # each object: magic + Unknown, as upstream
    assert {tm for tm, _ in objects} == {("resource.k8s.io/v1", "ResourceSlice")}
    slices = [pb.ResourceSlice.FromString(raw) for _, raw in objects]
    assert [s.metadata.name for s in slices] == ["w1"] * 3 and dict(slices[1].metadata.labels) == {"x": "y"}
    assert as_json(slices[0])["spec"] == SLICE_SPEC


POD = {
    "metadata": {"name": "p1", "namespace": "default", "labels": {"app": "x"}},
    "spec": {
        "containers": [
            {
                "name": "c",
                "image": "busybox",
                "command": ["sh", "-c"],
                "args": ["nvidia-smi -L"],
                "env": [{"name": "A", "value": "1"}],
                "resources": {"limits": {"cpu": "500m"}, "requests": {"memory": "1Gi"}},
            }
        ],
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 5,
    },
}
NODE = {
    "metadata": {"name": "n1", "labels": {"kubernetes.io/hostname": "n1"}},
    "spec": {"providerID": "local://n1", "taints": [{"key": "gpu", "value": "true", "effect": "NoSchedule"}]},
    "status": {"capacity": {"cpu": "8", "nvidia.com/gpu": "4"}, "allocatable": {"cpu": "7500m"}},
}
LEASE = {
    "metadata": {"name": "l1", "namespace": "default"},
    "spec": {
        "holderIdentity": "me",
        "leaseDurationSeconds": 15,
        "acquireTime": "2026-01-02T03:04:05.123456Z",
        "renewTime": "2026-01-02T03:04:06.000001Z",
        "leaseTransitions": 2,
    },
}


@pytest.mark.parametrize(
    ("path", "api_version", "kind", "obj"),
    [
        ("/api/v1/namespaces/default/pods", "v1", "Pod", POD),
        ("/api/v1/nodes", "v1", "Node", NODE),
        ("/apis/coordination.k8s.io/v1/namespaces/default/leases", "coordination.k8s.io/v1", "Lease", LEASE),
    ],
)
async def test_pod_node_lease_round_trip(
    k8s: Client, path: str, api_version: str, kind: str, obj: dict[str, Any]
) -> None:
    pb = k8s.pb
    cls = getattr(pb, kind)
    status, _, raw = await k8s("POST", path, wrap(pb, api_version, kind, build(cls, obj)))
    assert status == 201, raw
    stored = await k8s.json(f"{path}/{obj['metadata']['name']}")
    assert subset(obj, stored), (obj, stored)
    status, _, raw = await k8s("GET", f"{path}/{obj['metadata']['name']}")
    assert status == 200 and unwrap(pb, raw)[0] == (api_version, kind)
    back = as_json(cls.FromString(unwrap(pb, raw)[1]))
    assert subset(obj, back), (obj, back)
    assert back["metadata"]["uid"] == stored["metadata"]["uid"]


async def test_malformed_bodies_are_400_and_store_nothing(k8s: Client) -> None:
    pb = k8s.pb
    good = wrap(
        pb,
        "resource.k8s.io/v1",
        "ResourceSlice",
        build(pb.ResourceSlice, {"metadata": {"name": "cut"}, "spec": SLICE_SPEC}),
    )
    for body in (good[:-7], good[:3], MAGIC, MAGIC + b"\x0a\xff\xff"):
        status, ctype, raw = await k8s("POST", SLICES, body)
        assert status == 400 and ctype == PROTO, (body, raw)
        failure = pb.Status.FromString(unwrap(pb, raw)[1])
        assert failure.reason == "BadRequest" and "protobuf" in failure.message
    status, _, raw = await k8s("POST", SLICES, good[:-7], accept="application/json")
    message = msgspec.json.decode(raw)["message"]
    assert status == 400 and "malformed: field 2: 144 bytes announced at byte 40, only 137 left" in message
    assert (await k8s("GET", f"{SLICES}/cut"))[0] == 404
    status, _, raw = await k8s("PATCH", f"{SLICES}/s1", good)  # no patch type is protobuf
    assert status == 415


async def test_custom_resources_stay_json(k8s: Client) -> None:
    crd = yaml.safe_load((Path(__file__).parents[1] / "fixtures/reference/computedomain-crd.yaml").read_text())
    status, _, raw = await k8s(
        "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd, accept="application/json"
    )
    assert status == 201, raw
    version = next(v["name"] for v in crd["spec"]["versions"] if v.get("storage"))
    path = f"/apis/resource.nvidia.com/{version}/namespaces/default/computedomains"
    status, ctype, raw = await k8s("GET", path)  # protobuf, */* -> JSON
    assert status == 200 and ctype.startswith("application/json")
    assert msgspec.json.decode(raw)["kind"] == "ComputeDomainList"
    status, _, raw = await k8s("GET", path, accept=PROTO)
    assert status == 406 and b"NotAcceptable" in raw
    status, ctype, raw = await k8s("GET", f"{path}/missing")  # errors too stay JSON for custom resources
    assert status == 404 and ctype.startswith("application/json") and b"NotFound" in raw
    pb = k8s.pb
    body = wrap(pb, f"resource.nvidia.com/{version}", "ComputeDomain", build(pb.Lease, {"metadata": {"name": "cd"}}))
    status, _, raw = await k8s("POST", path, body)
    assert status == 415 and b"UnsupportedMediaType" in raw


async def test_an_object_that_does_not_fit_its_message_is_answered_in_json(k8s: Client) -> None:
    """Nothing the API accepts stores such a value; if one got in, client-go gets JSON, not a 500."""
    odd = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "odd", "namespace": "default"},
        "data": {"n": 5},
    }
    k8s.api.server.store.put(("", "configmaps"), ("default", "odd"), odd)
    status, ctype, raw = await k8s("GET", "/api/v1/namespaces/default/configmaps/odd")
    assert status == 200 and ctype == "application/json" and msgspec.json.decode(raw)["data"] == {"n": 5}
    status, ctype, _ = await k8s("GET", "/api/v1/namespaces/default/configmaps")
    assert status == 200 and ctype == "application/json"
