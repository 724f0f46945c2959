"""The 422 Status of an invalid object, as the real API server writes it: message, reason, details and
causes, for a resource.k8s.io kind and for a core one with several errors."""

from __future__ import annotations

from embedded.apiserver.validation import FieldError, invalid_status
from tests.apiserver.validation_objects import h100_slice, slice_errors


def test_invalid_status_matches_the_real_server() -> None:
    errors = slice_errors(h100_slice(devices=129))
    status = invalid_status("ResourceSlice.resource.k8s.io", "x", errors)
    assert status == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'ResourceSlice.resource.k8s.io "x" is invalid: '
        "spec.devices: Too many: 129: must have at most 128 items",
        "reason": "Invalid",
        "details": {
            "name": "x",
            "group": "resource.k8s.io",
            "kind": "ResourceSlice",
            "causes": [
                {
                    "reason": "FieldValueTooMany",
                    "message": "Too many: 129: must have at most 128 items",
                    "field": "spec.devices",
                }
            ],
        },
        "code": 422,
    }
    two = [
        FieldError("FieldValueRequired", "metadata.name", "name or generateName is required"),
        FieldError("FieldValueInvalid", "spec.x", "bad", "v"),
    ]
    core = invalid_status("Pod", "p", two)
    assert core["message"] == (
        'Pod "p" is invalid: [metadata.name: Required value: name or generateName is required, '
        'spec.x: Invalid value: "v": bad]'
    )
    assert "group" not in core["details"] and core["details"]["kind"] == "Pod"
