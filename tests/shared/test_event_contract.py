"""The third-party contract (issue 22): AsyncAPI document, field docs, CloudEvents on the wire, the
compatibility promise, and `gpu-dra events tail`, all through the real parts (nats-server, processes)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
from cloudevents.core.bindings.http import HTTPMessage, from_binary
from cloudevents.core.formats.json import JSONFormat

from shared.bus import Bus
from shared.events import catalog, cloudevents, compat
from shared.events.asyncapi import document
from shared.events.base import Message
from shared.events.claims import ClaimLifecycle, PreparedDeviceRef
from shared.events.computedomain import DomainDeleted, DomainMember, DomainStatusChanged, MemberLeft
from shared.events.deadletter import DeadLetter
from shared.events.health import DeviceHealth
from shared.events.inventory import Gpu, InventoryWithdrawn, NodeInventory
from shared.events.schema import message_schema, write_schemas
from shared.events.telemetry import DeviceSample, NodeTelemetry
from shared.natsserver import EmbeddedNats

FIXTURES = Path(__file__).parent.parent / "fixtures"
NOW = 1_764_800_000.25

SAMPLES: dict[str, tuple[Message, dict[str, Any]]] = {  # Any: the subject tokens go in as **kwargs
    "inventory": (
        NodeInventory(
            node="n1",
            driver_version="550.1.0",
            cuda_driver_version="12.4.0",
            observed_at=NOW,
            gpus=[
                Gpu(
                    name="gpu-0",
                    index=0,
                    minor=0,
                    uuid="GPU-1",
                    product_name="H100",
                    brand="Nvidia",
                    architecture="Hopper",
                    cuda_compute_capability="9.0.0",
                    memory_bytes=80 << 30,
                    pci_bus_id="0000:01:00.0",
                )
            ],
        ),
        {"node": "n1"},
    ),
    "inventory-withdrawn": (InventoryWithdrawn(node="n1", reason="drained", observed_at=NOW), {"node": "n1"}),
    "device-health": (
        DeviceHealth(node="n1", device="gpu-0", state="Unhealthy", reason="xid", xid=79, observed_at=NOW),
        {"node": "n1", "device": "gpu-0"},
    ),
    "telemetry": (
        NodeTelemetry(
            node="n1",
            interval_s=10.0,
            observed_at=NOW,
            devices=[
                DeviceSample(
                    device="gpu-0",
                    uuid="GPU-1",
                    sm_percent=87,
                    memory_used_bytes=61 << 30,
                    memory_total_bytes=80 << 30,
                    power_mw=512_000,
                    temperature_c=64,
                ),
                DeviceSample(device="gpu-0-mig-1g10gb-19-0", uuid="MIG-1", memory_total_bytes=10 << 30),
            ],
        ),
        {"node": "n1"},
    ),
    "claim-lifecycle": (
        ClaimLifecycle(
            event="prepared",
            node="n1",
            driver="gpu.nvidia.com",
            claim_uid="u1",
            claim_namespace="team-a",
            claim_name="c1",
            event_id="n1/u1/7/prepared",
            devices=[
                PreparedDeviceRef(request="gpu", pool="n1", device="gpu-0"),
                PreparedDeviceRef(
                    request="slice",
                    pool="n1",
                    device="gpu-1",
                    share_id="s-1",
                    capacity={"memory": "80Gi"},
                    consumed_capacity={"memory": "10Gi"},
                ),
            ],
            observed_at=NOW,
        ),
        {"namespace": "team-a", "node": "n1", "event": "prepared"},
    ),
    "cd-member": (
        DomainMember(
            domain_uid="d1",
            domain_name="cd",
            domain_namespace="team-a",
            node="n1",
            ip_address="10.0.0.1",
            clique_id="c.1",
            index=0,
            observed_at=NOW,
        ),
        {"domain_uid": "d1", "node": "n1"},
    ),
    "cd-status": (
        DomainStatusChanged(
            domain_uid="d1", domain_name="cd", domain_namespace="team-a", status="Ready", nodes=2, observed_at=NOW
        ),
        {"domain_uid": "d1"},
    ),
    "cd-member-left": (MemberLeft(domain_uid="d1", node="n1", observed_at=NOW), {"domain_uid": "d1", "node": "n1"}),
    "cd-deleted": (
        DomainDeleted(domain_uid="d1", domain_name="cd", domain_namespace="team-a", observed_at=NOW),
        {"domain_uid": "d1"},
    ),
    "dead-letter": (
        DeadLetter(subject="dra.v1.x", consumer="c", error="bad", payload="{", observed_at=NOW),
        {"identity": "publisher", "consumer": "c"},
    ),
}


def _schemas(tmp_path: Path) -> compat.Schemas:
    write_schemas(tmp_path)
    return compat.load(tmp_path)


def test_asyncapi_document_is_valid_asyncapi_3_and_names_every_catalog_message() -> None:
    doc = document()
    schema = json.loads((FIXTURES / "asyncapi/asyncapi-3.0.0.schema.json").read_text())
    errors = [f"{list(e.path)}: {e.message[:200]}" for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
    assert errors == []
    for entry in catalog.CATALOG:
        channel = doc["channels"][entry.name]
        assert channel["address"] == entry.subject
        assert set(channel.get("parameters", {})) == set(entry.tokens)
        assert entry.message.__name__ in doc["components"]["messages"]
        if entry.reply:
            assert entry.reply.__name__ in doc["components"]["messages"]
            assert doc["operations"][entry.name]["reply"]
    for bucket in catalog.BUCKETS:
        assert doc["channels"][f"kv-{bucket.name}"]["x-gpu-dra-kv"]["bucket"] == bucket.name
    # the validator does look inside: a wrong action is an error
    doc["operations"]["claim-lifecycle"]["action"] = "publish"
    assert list(jsonschema.Draft7Validator(schema).iter_errors(doc))


def test_every_field_of_every_message_has_a_description(tmp_path: Path) -> None:
    undocumented = []
    for name, schema in _schemas(tmp_path).items():
        for type_name, part in {name: schema, **schema.get("$defs", {})}.items():
            undocumented += [
                f"{type_name}.{field}"
                for field, prop in part.get("properties", {}).items()
                if not prop.get("description")
            ]
    assert undocumented == []
    observed = message_schema(ClaimLifecycle)["properties"]["observed_at"]
    assert observed["x-unit"] == "s" and "Unix epoch" in observed["description"]


def test_every_field_is_on_the_wire_even_at_its_default() -> None:
    for message, _ in SAMPLES.values():
        body = json.loads(msgspec.json.encode(message))
        assert set(body) == set(message.__struct_fields__), type(message).__name__


async def test_a_cloudevents_sdk_reads_every_event_type_we_publish(nats_server: EmbeddedNats, bus: Bus) -> None:
    events = [e for e in catalog.CATALOG if e.pattern == "event"]
    assert set(SAMPLES) == {e.name for e in events}, "a sample per event type"
    reader = await Bus.connect(nats_server.url, name="third-party")
    got: asyncio.Queue[Any] = asyncio.Queue()
    sub = await reader.nc.subscribe("dra.v1.>", cb=got.put)
    await reader.nc.flush()
    try:
        for entry in events:
            message, tokens = SAMPLES[entry.name]
            await bus.publish(entry, message, **tokens)
        for _ in events:
            msg = await asyncio.wait_for(got.get(), 10)
            entry = next(e for e in events if e.parse(msg.subject) is not None)
            message, _ = SAMPLES[entry.name]
            event = from_binary(HTTPMessage(headers=dict(msg.headers), body=msg.data), JSONFormat())
            assert event.get_type() == f"com.nvidia.gpu.dra.v1.{entry.name}"
            assert event.get_source() == "/gpu-dra/test-harness"
            assert event.get_subject() == msg.subject
            sent = event.get_time()
            assert sent is not None and sent.timestamp() == pytest.approx(NOW, abs=1e-5)
            assert event.get_data() == json.loads(msgspec.json.encode(message))
            if entry is catalog.CLAIM:
                assert event.get_id() == "n1/u1/7/prepared", "a claim's CloudEvents id is its event id"
            assert event.get_id()
    finally:
        await sub.unsubscribe()
        await reader.close()


def test_claim_events_carry_shares_in_their_schema_and_on_the_wire(tmp_path: Path) -> None:
    message, _ = SAMPLES["claim-lifecycle"]
    body = json.loads(msgspec.json.encode(message))
    whole, share = body["devices"]
    assert (whole["share_id"], whole["consumed_capacity"], whole["capacity"]) == ("", {}, {})
    assert (share["share_id"], share["consumed_capacity"], share["capacity"]) == (
        "s-1",
        {"memory": "10Gi"},
        {"memory": "80Gi"},
    )
    assert msgspec.json.decode(msgspec.json.encode(message), type=ClaimLifecycle) == message
    # a consumer of the older schema (no share fields) still reads it
    old = {
        **body,
        "devices": [
            {k: v for k, v in d.items() if k not in ("share_id", "consumed_capacity", "capacity")}
            for d in body["devices"]
        ],
    }
    assert msgspec.json.decode(json.dumps(old), type=ClaimLifecycle).devices[1].share_id == ""
    schema = _schemas(tmp_path)["ClaimLifecycle.json"]
    device = schema["$defs"]["PreparedDeviceRef"]
    jsonschema.validate(body, schema)
    for name in ("share_id", "consumed_capacity", "capacity"):
        assert name in device["properties"] and name not in device.get("required", []), name
    assert device["properties"]["consumed_capacity"]["additionalProperties"] == {"type": "string"}
    assert "shareID" in device["properties"]["share_id"]["description"]
    assert "PreparedDeviceRef" in json.dumps(document()["components"]["schemas"])
    doc_device = document()["components"]["schemas"]["PreparedDeviceRef"]
    assert "consumed_capacity" in doc_device["properties"]


def test_the_released_v1_schemas_still_hold(tmp_path: Path) -> None:
    released = compat.load(FIXTURES / "events/v1")
    assert "index.json" in released and "ClaimLifecycle.json" in released
    assert compat.breaking_changes(released, _schemas(tmp_path)) == []


def test_removing_a_field_from_a_copy_of_the_catalog_is_a_breaking_change(tmp_path: Path) -> None:
    released = compat.load(FIXTURES / "events/v1")
    current = _schemas(tmp_path)
    # a copy of the claim event type without one field, as a careless change would make it
    shrunk = msgspec.defstruct(
        "ClaimLifecycle", _field_specs(ClaimLifecycle, "claim_name"), bases=(Message,), kw_only=True
    )
    current["ClaimLifecycle.json"] = message_schema(shrunk)
    assert compat.breaking_changes(released, current) == ["ClaimLifecycle: field 'claim_name' removed"]
    # ... and a changed type, a newly required field and a removed subject are breaking too
    retyped = json.loads(json.dumps(current))
    retyped["ClaimLifecycle.json"] = json.loads(json.dumps(released["ClaimLifecycle.json"]))
    retyped["ClaimLifecycle.json"]["properties"]["observed_at"] = {"type": "string"}
    retyped["ClaimLifecycle.json"]["required"].append("error")
    retyped["index.json"]["subjects"] = [s for s in retyped["index.json"]["subjects"] if s["name"] != "cd-status"]
    found = compat.breaking_changes(released, retyped)
    assert "ClaimLifecycle: field 'observed_at' changed type" in found
    assert "ClaimLifecycle: field 'error' newly required" in found
    assert any("cd-status" in line and "removed" in line for line in found)
    # adding an optional field is not
    grown = json.loads(json.dumps(released))
    grown["ClaimLifecycle.json"]["properties"]["new_field"] = {"type": "string", "description": "new"}
    assert compat.breaking_changes(released, grown) == []


def _field_specs(struct: type[msgspec.Struct], without: str) -> list[tuple[Any, ...]]:
    """`struct`'s fields as msgspec.defstruct takes them, less one."""
    specs: list[tuple[Any, ...]] = []
    for f in msgspec.structs.fields(struct):
        if f.name == without:
            continue
        if f.default is not msgspec.NODEFAULT:
            specs.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            specs.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            specs.append((f.name, f.type))
    return specs


async def test_events_tail_replays_and_filters_by_namespace(nats_server: EmbeddedNats, bus: Bus) -> None:
    for namespace, event in (("team-a", "prepared"), ("team-b", "prepared"), ("team-a", "unprepared")):
        message, _ = SAMPLES["claim-lifecycle"]
        message = msgspec.structs.replace(
            message, event=event, claim_namespace=namespace, event_id=f"n1/u1/7/{event}-{namespace}"
        )
        await bus.publish(catalog.CLAIM, message, namespace=namespace, node="n1", event=event)
    env = {**os.environ, "GPU_DRA_NATS_URL": nats_server.url}
    for key in ("GPU_DRA_NATS_CREDS", "GPU_DRA_NATS_USER"):
        env.pop(key, None)
    done = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "shared.cli",
            "events",
            "tail",
            "--since",
            "10m",
            "--namespace",
            "team-a",
            "-o",
            "json",
            "--count",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["data"]["claim_namespace"], r["data"]["event"]) for r in lines] == [
        ("team-a", "prepared"),
        ("team-a", "unprepared"),
    ]
    assert lines[0]["type"] == "com.nvidia.gpu.dra.v1.claim-lifecycle" and lines[0]["id"] == "n1/u1/7/prepared-team-a"
    bad = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "shared.cli", "events", "tail", "--since", "ten"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert bad.returncode == 2 and "--since 'ten'" in bad.stderr


def test_cloudevents_type_names_the_subject_version() -> None:
    assert cloudevents.event_type(catalog.CLAIM) == "com.nvidia.gpu.dra.v1.claim-lifecycle"


def test_cloudevents_time_is_the_microsecond_datetime_writes() -> None:
    """`ce-time` is formatted per second once, not per event: the same text as datetime's, rounding included
    (half to even on the fraction's microseconds, a fraction that rounds up carried into the next second)."""
    rng = random.Random(5075)
    edges = [0.0, 1e-7, 5e-7, 1.5e-6, 2.5e-6, -0.5, -1.0000004, 1796586156.9999996, 1796586156.9999994]
    for unix_s in edges + [rng.uniform(0, 4e9) for _ in range(20_000)]:
        want = datetime.datetime.fromtimestamp(unix_s, datetime.UTC).isoformat(timespec="microseconds")
        assert cloudevents.rfc3339(unix_s) == want.replace("+00:00", "Z"), unix_s


def test_telemetry_is_in_the_exported_contract_and_in_no_stream(tmp_path: Path) -> None:
    """Utilisation telemetry is a catalog event with its schema like every other, but core NATS only: no
    stream captures its subject (a stream would store ~0.3 MB/s at 1,000 nodes of figures stale in 10 s)."""
    schemas = _schemas(tmp_path)
    listed = next(e for e in schemas["index.json"]["subjects"] if e["name"] == "telemetry")
    assert (listed["subject"], listed["schema"], listed["binds"]) == (
        "dra.v1.telemetry.{node}",
        "NodeTelemetry.json",
        {"node": "node"},
    )
    message, _ = SAMPLES["telemetry"]
    body = json.loads(msgspec.json.encode(message))
    jsonschema.validate(body, schemas["NodeTelemetry.json"])
    assert body["devices"][1]["sm_percent"] is None, "a figure NVML does not give is null on the wire"
    sample = schemas["NodeTelemetry.json"]["$defs"]["DeviceSample"]["properties"]
    assert sample["power_mw"]["x-unit"] == "mW" and sample["memory_used_bytes"]["x-unit"] == "bytes"
    assert "x-gpu-dra-stream" not in document()["channels"]["telemetry"]
    assert not catalog.TELEMETRY.durable and all(e.durable for e in catalog.CATALOG if e is not catalog.TELEMETRY)
    for stream in catalog.STREAMS:
        assert not any(s.startswith("dra.v1.telemetry") or s in ("dra.v1.>", ">") for s in stream.subjects)


def test_events_tail_shows_telemetry_only_when_asked_and_never_replays_it() -> None:
    from shared.events import tail

    assert not any(s.startswith("dra.v1.telemetry") for s in tail.subjects(catalog.CATALOG, "", "", ""))
    assert tail.subjects(catalog.CATALOG, "n1", "", "telemetry") == ["dra.v1.telemetry.n1"]
    args = argparse.Namespace(type="telemetry", since="10m", node="", namespace="", output="line", count=0)
    with pytest.raises(tail.TailError, match="not stored"):
        tail.run(args, sys.stdout)
