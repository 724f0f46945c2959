"""The protobuf codec on its own: JSON -> protobuf -> JSON is the identity (for the fields the
messages know) over every built-in object in tests/fixtures, and the apimachinery types that are not
objects in JSON (IntOrString, RawExtension, Quantity, Time, MicroTime, Duration) convert both ways."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from embedded.apiserver import protobuf, wire

FIXTURES = Path(__file__).parents[1] / "fixtures"


def _fixture_objects() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(FIXTURES.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for obj in (doc.get("items") or [doc]) if isinstance(doc, dict) else []:
                if protobuf.can_encode(obj):
                    found.append((f"{path.name}:{obj['kind']}/{obj['metadata'].get('name', '')}", obj))
    return found


def _protobuf_form(value: Any) -> Any:
    """What protobuf can carry: no nulls, and an empty list or map is the same as none; a quantity written
    as a YAML number (NVIDIA's spec's `capacity: {requests: {shares: 1}}`) comes back as its string, as
    from kube-apiserver."""
    if isinstance(value, dict):
        if isinstance(value.get("requests"), dict) and set(value) == {"requests"}:  # CapacityRequirements
            value = {"requests": {k: str(v) if isinstance(v, int | float) else v for k, v in value["requests"].items()}}
        out = {k: _protobuf_form(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v is not None and v != [] and not (v == {} and k != "spec")}
    if isinstance(value, list):
        return [_protobuf_form(v) for v in value]
    return value


FOUND = _fixture_objects()


def test_fixtures_hold_built_in_objects() -> None:
    kinds = {obj["kind"] for _, obj in FOUND}
    assert {"Pod", "ResourceClaimTemplate", "Namespace", "Deployment"} <= kinds, kinds
    assert len(FOUND) >= 30


@pytest.mark.parametrize(("name", "obj"), FOUND, ids=[n for n, _ in FOUND])
def test_json_protobuf_json_is_identity(name: str, obj: dict[str, Any]) -> None:
    encoded = protobuf.encode_object(obj)
    assert encoded.startswith(protobuf.MAGIC)
    assert protobuf.decode_body(encoded) == _protobuf_form(obj)


def test_special_types_both_ways() -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "creationTimestamp": "2026-03-04T05:06:07Z"},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "ports": [{"containerPort": 80}],
                    "readinessProbe": {"httpGet": {"port": "http", "path": "/"}},
                    "livenessProbe": {"tcpSocket": {"port": 8080}},
                    "resources": {"limits": {"nvidia.com/gpu": "1", "memory": "1.5Gi"}},
                }
            ],
            "volumes": [{"name": "v", "emptyDir": {"sizeLimit": "1Gi"}}],
        },
    }
    assert protobuf.decode_body(protobuf.encode_object(pod)) == pod  # inline VolumeSource, ProbeHandler
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "l"},
        "spec": {"renewTime": "2026-03-04T05:06:07.250000Z", "leaseDurationSeconds": 0},
    }
    assert protobuf.decode_body(protobuf.encode_object(lease)) == lease  # a pointer's zero is kept
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c"},
        "spec": {
            "devices": {
                "config": [
                    {
                        "opaque": {
                            "driver": "gpu.nvidia.com",
                            "parameters": {
                                "apiVersion": "resource.nvidia.com/v1beta1",
                                "kind": "GpuConfig",
                                "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
                            },
                        }
                    }
                ]
            }
        },
    }
    assert protobuf.decode_body(protobuf.encode_object(claim)) == claim  # RawExtension as JSON
    assert protobuf._format_duration(protobuf._parse_duration("1h2m3.5s")) == "1h2m3.5s"
    assert protobuf._format_duration(1_500_000) == "1.5ms" and protobuf._format_duration(0) == "0s"


def test_go_zero_values_read_as_go_json_would() -> None:
    """gogo protobuf writes every non-pointer field; Go's JSON omits the omitempty ones when zero."""
    meta = (
        wire.bytes_field(1, b"n")
        + wire.bytes_field(2, b"")
        + wire.bytes_field(3, b"")
        + wire.int_field(7, 0)
        + wire.bytes_field(8, b"")
    )  # name, generateName, namespace, generation, time
    spec = wire.bytes_field(1, b"") + wire.int_field(2, 0) + wire.int_field(5, 0)  # all three are pointers in Go
    body = protobuf.envelope(
        "coordination.k8s.io/v1",
        "Lease",
        wire.bytes_field(1, meta) + wire.bytes_field(2, spec) + wire.bytes_field(7, b"unknown field"),
    )
    assert protobuf.decode_body(body) == {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "n"},
        "spec": {"holderIdentity": "", "leaseDurationSeconds": 0, "leaseTransitions": 0},
    }


def test_negotiation_follows_the_clients_order() -> None:
    assert protobuf.prefers_protobuf("application/vnd.kubernetes.protobuf, */*")
    assert protobuf.prefers_protobuf("application/vnd.kubernetes.protobuf,application/json")
    assert not protobuf.prefers_protobuf("application/json, application/vnd.kubernetes.protobuf")
    assert not protobuf.prefers_protobuf("application/vnd.kubernetes.protobuf;q=0.5, application/json")
    assert not protobuf.prefers_protobuf("application/vnd.kubernetes.protobuf;as=Table;v=v1;g=meta.k8s.io")
    assert not protobuf.prefers_protobuf("")
    assert protobuf.accepts_json("") and not protobuf.accepts_json(protobuf.MEDIA_TYPE)


def test_generator_reads_proto_and_go_tags() -> None:
    """protoschema/generate.py's two parsers, on a snippet in upstream's layout (the generator itself
    runs against the upstream repositories, not in the tests)."""
    from embedded.apiserver.protoschema import generate

    proto = """
// +protobuf.nullable=true
message ExtraValue {
  repeated string items = 1;
}
message Volume {
  optional string name = 1;
  optional VolumeSource volumeSource = 2;
  map<string, .k8s.io.apimachinery.pkg.api.resource.Quantity> limits = 3;
}
"""
    messages, nullable = generate.parse_proto(proto, "k8s.io.api.core.v1")
    assert nullable == {"k8s.io.api.core.v1.ExtraValue"}
    assert messages["k8s.io.api.core.v1.Volume"] == [
        ("name", "optional", 1, "string"),
        ("volumeSource", "optional", 2, "k8s.io.api.core.v1.VolumeSource"),
        ("limits", "map", 3, ("string", "k8s.io.apimachinery.pkg.api.resource.Quantity")),
    ]
    go = """
type Volume struct {
	// comment `json:"ignored" protobuf:"bytes,9,opt,name=ignored"`
	Name string `json:"name" protobuf:"bytes,1,opt,name=name"`
	VolumeSource `json:",inline" protobuf:"bytes,2,opt,name=volumeSource"`
	Limits ResourceList `json:"limits,omitempty" protobuf:"bytes,3,rep,name=limits,casttype=ResourceList"`
	Size *int64 `json:"sizeBytes,omitempty" protobuf:"varint,4,opt,name=size"`
}
"""
    assert generate.parse_go(go) == {
        ("Volume", 1): ("name", False, True),
        ("Volume", 2): ("", True, True),
        ("Volume", 3): ("limits", False, False),
        ("Volume", 4): ("sizeBytes", False, True),
    }
