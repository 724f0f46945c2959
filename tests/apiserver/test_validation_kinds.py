"""Validation of metadata and of kinds other than resource.k8s.io's as the real API server does it:
names, labels and annotations, other built-in kinds by their upstream schemas, an unknown kind, and the
reference workloads (tests/fixtures/reference/workloads) all valid."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import yaml

from embedded.apiserver.validation import validate_object
from tests.apiserver.validation_objects import fields

WORKLOADS = Path(__file__).resolve().parents[1] / "fixtures" / "reference" / "workloads"


def test_metadata_rules() -> None:
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    assert fields(validate_object("", "v1", "Pod", pod)) == {"metadata.name": "FieldValueRequired"}
    pod["metadata"]["generateName"] = "worker-"
    assert validate_object("", "v1", "Pod", pod) == []
    pod["metadata"]["labels"] = {"bad key!": "v", "ok": "bad value!"}
    pod["metadata"]["annotations"] = {"example.com/a": "x" * (256 * 1024)}
    assert fields(validate_object("", "v1", "Pod", pod)) == {
        "metadata.labels": "FieldValueInvalid",
        "metadata.labels[ok]": "FieldValueInvalid",
        "metadata.annotations": "FieldValueTooLong",
    }
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a.b"}}
    assert fields(validate_object("", "v1", "Namespace", ns)) == {"metadata.name": "FieldValueInvalid"}


def test_other_builtin_kinds_use_their_schema() -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "x"},
        "spec": {
            "replicas": "three",
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": "i", "imagePullPolicy": 1}]},
            },
        },
    }
    assert fields(validate_object("apps", "v1", "Deployment", deployment)) == {
        "spec.replicas": "FieldValueTypeInvalid",
        "spec.template.spec.containers[0].imagePullPolicy": "FieldValueTypeInvalid",
    }
    lease: dict[str, Any] = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "l", "namespace": "x"},
        "spec": {"holderIdentity": "me", "renewTime": "2026-12-03T06:00:00.000000Z", "leaseDurationSeconds": 15},
    }
    assert validate_object("coordination.k8s.io", "v1", "Lease", lease) == []
    lease["spec"]["renewTime"] = "yesterday"
    assert fields(validate_object("coordination.k8s.io", "v1", "Lease", lease)) == {
        "spec.renewTime": "FieldValueInvalid"
    }
    unknown = validate_object("example.com", "v1", "Gadget", {"metadata": {"name": "g"}})
    assert unknown[0].type == "FieldValueNotSupported" and "Gadget" in unknown[0].message


def test_reference_workloads_are_valid() -> None:
    count = 0
    for path in sorted(glob.glob(str(WORKLOADS / "*.yaml"))):
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if not doc:
                continue
            group, _, version = doc["apiVersion"].rpartition("/")
            assert validate_object(group, version, doc["kind"], doc) == [], (path, doc["kind"])
            count += 1
    assert count > 20
