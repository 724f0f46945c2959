"""Custom resources validated against their CRD's structural schema as the real API server does it:
types, bounds, enums, patterns, list sets and maps, unknown fields, the ComputeDomain CRD and its
immutable spec, and CEL rules (x-kubernetes-validations) with messages, reasons and field paths."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from embedded.apiserver.validation import UNKNOWN_FIELD, validate_custom, validate_object
from tests.apiserver.validation_objects import fields

COMPUTEDOMAIN_CRD = Path(__file__).resolve().parents[1] / "fixtures" / "reference" / "computedomain-crd.yaml"

WIDGET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "required": ["size"],
            "properties": {
                "size": {"type": "integer", "minimum": 1, "maximum": 10},
                "color": {"type": "string", "enum": ["red", "blue"]},
                "name": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8},
                "tags": {"type": "array", "maxItems": 2, "items": {"type": "string"}, "x-kubernetes-list-type": "set"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "note": {"type": "string", "nullable": True},
            },
        },
        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    },
}


def widget(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "example.com/v1",
        "kind": "Widget",
        "metadata": {"name": "w", "namespace": "default"},
        "spec": {"size": 3, **spec},
    }


def test_custom_resource_valid_and_invalid() -> None:
    good = widget(color="red", name="abc", tags=["a"], labels={"x": "y"}, free={"any": {"thing": 1}}, note=None)
    assert validate_custom(WIDGET_SCHEMA, good) == []
    bad = widget(size=11, color="green", name="ABC", tags=["a", "a"], labels={"x": 1}, note=None, extra=True)
    errors = fields(validate_custom(WIDGET_SCHEMA, bad))
    assert errors == {
        "spec.size": "FieldValueInvalid",
        "spec.color": "FieldValueNotSupported",
        "spec.name": "FieldValueInvalid",
        "spec.tags[1]": "FieldValueDuplicate",
        "spec.labels[x]": "FieldValueTypeInvalid",
        "spec.extra": UNKNOWN_FIELD,
    }
    missing = widget()
    del missing["spec"]["size"]
    missing["spec"]["name"] = None
    assert fields(validate_custom(WIDGET_SCHEMA, missing)) == {
        "spec.size": "FieldValueRequired",
        "spec.name": "FieldValueTypeInvalid",
    }


def test_computedomain_crd_and_resource() -> None:
    crd = yaml.safe_load(COMPUTEDOMAIN_CRD.read_text())
    assert validate_object("apiextensions.k8s.io", "v1", "CustomResourceDefinition", crd) == []
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    domain: dict[str, Any] = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": "imex", "namespace": "default"},
        "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": "imex-channel"}}},
    }
    assert validate_custom(schema, domain) == []
    resized = copy.deepcopy(domain)
    resized["spec"]["numNodes"] = 3  # the CRD's CEL rule `self == oldSelf` keeps spec immutable
    errors = validate_custom(schema, resized, domain)
    assert [str(e) for e in errors] == ['spec: Invalid value: "object": A computeDomain.spec is immutable']
    assert validate_custom(schema, resized) == []  # a transition rule has nothing to compare on create
    domain["spec"]["channel"]["allocationMode"] = "Some"
    assert fields(validate_custom(schema, domain)) == {"spec.channel.allocationMode": "FieldValueNotSupported"}
    broken = copy.deepcopy(crd)
    broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"][0][
        "rule"
    ] = "self =="
    assert fields(validate_object("apiextensions.k8s.io", "v1", "CustomResourceDefinition", broken)) == {
        "spec.versions[0].schema.openAPIV3Schema.properties[spec].x-kubernetes-validations[0].rule": "FieldValueInvalid"
    }


def test_cel_rules_on_maps_lists_and_reasons() -> None:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "properties": {
                    "replicas": {
                        "type": "integer",
                        "x-kubernetes-validations": [{"rule": "self <= 5", "message": "at most 5 replicas"}],
                    },
                    "ports": {
                        "type": "array",
                        "x-kubernetes-list-type": "map",
                        "x-kubernetes-list-map-keys": ["name"],
                        "items": {
                            "type": "object",
                            "properties": {"name": {"type": "string"}, "port": {"type": "integer"}},
                            "x-kubernetes-validations": [
                                {
                                    "rule": "self.port == oldSelf.port",
                                    "message": "port is immutable",
                                    "reason": "FieldValueForbidden",
                                }
                            ],
                        },
                    },
                },
                "x-kubernetes-validations": [
                    {
                        "rule": "has(self.replicas)",
                        "fieldPath": ".replicas",
                        "reason": "FieldValueRequired",
                        "message": "replicas is required",
                    }
                ],
            }
        },
    }
    old = widget(replicas=2, ports=[{"name": "a", "port": 1}, {"name": "b", "port": 2}])
    old["spec"].pop("size")
    assert validate_custom(schema, old) == []
    new = copy.deepcopy(old)
    new["spec"]["replicas"] = 9
    new["spec"]["ports"] = [{"name": "b", "port": 3}, {"name": "c", "port": 4}]  # b changed, c is new
    assert [(e.type, e.field, e.message) for e in validate_custom(schema, new, old)] == [
        ("FieldValueInvalid", "spec.replicas", "at most 5 replicas"),
        ("FieldValueForbidden", "spec.ports[0]", "port is immutable"),
    ]
    del new["spec"]["replicas"]
    assert fields(validate_custom(schema, new)) == {"spec.replicas": "FieldValueRequired"}
