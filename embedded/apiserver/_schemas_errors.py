"""Field errors as the real API server reports them: one `FieldError` per problem, its StatusCause,
and the 422 `Invalid` Status built from a list of them (k8s.io/apimachinery field.Error formatting)."""

from __future__ import annotations

import json
from typing import Any

import msgspec

REQUIRED = "FieldValueRequired"
INVALID = "FieldValueInvalid"
TOO_MANY = "FieldValueTooMany"
TOO_LONG = "FieldValueTooLong"
NOT_SUPPORTED = "FieldValueNotSupported"
FORBIDDEN = "FieldValueForbidden"
DUPLICATE = "FieldValueDuplicate"
TYPE_INVALID = "FieldValueTypeInvalid"
# Not a real StatusCause reason: the real server reports unknown fields either as a 400
# "strict decoding error" (fieldValidation=Strict) or as warnings (Warn). Kept distinct so the HTTP
# layer can choose; see `unknown_fields()` and `strict_decoding_message()`.
UNKNOWN_FIELD = "FieldValueUnknown"

# Human words per reason, as field.ErrorType.String() writes them.
_WORDS = {
    REQUIRED: "Required value",
    INVALID: "Invalid value",
    TOO_MANY: "Too many",
    TOO_LONG: "Too long",
    NOT_SUPPORTED: "Unsupported value",
    FORBIDDEN: "Forbidden",
    DUPLICATE: "Duplicate value",
    TYPE_INVALID: "Invalid value",
    UNKNOWN_FIELD: "Unknown field",
}
# Reasons whose message never shows the offending value.
_NO_VALUE = {REQUIRED, FORBIDDEN, TOO_LONG, UNKNOWN_FIELD}

_OMIT = object()


class FieldError(msgspec.Struct, frozen=True):
    """One validation failure at a dotted field path such as `spec.devices[3].attributes`."""

    type: str
    field: str
    message: str  # the detail, e.g. "must have at most 128 items"
    value: object | None = None

    def body(self) -> str:
        """What the real server puts in StatusCause.message: `Too many: 129: must have at most 128 items`."""
        if self.type == UNKNOWN_FIELD:
            return f'unknown field "{self.field}"'
        words = _WORDS.get(self.type, self.type)
        if self.type in _NO_VALUE or self.value is _OMIT:
            text = words
        else:
            text = f"{words}: {go_value(self.value)}"
        return f"{text}: {self.message}" if self.message else text

    def __str__(self) -> str:
        if self.type == UNKNOWN_FIELD or not self.field:
            return self.body()
        return f"{self.field}: {self.body()}"

    def to_cause(self) -> dict[str, Any]:
        return {"reason": self.type, "message": self.body(), "field": self.field}


def go_value(value: object) -> str:
    """Formats a bad value like field.Error does: strings quoted, numbers and bools bare, others as JSON."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    except (TypeError, ValueError):
        return repr(value)


def required(field: str, detail: str = "") -> FieldError:
    return FieldError(REQUIRED, field, detail)


def invalid(field: str, value: object, detail: str) -> FieldError:
    return FieldError(INVALID, field, detail, value)


def too_many(field: str, actual: int, limit: int) -> FieldError:
    return FieldError(TOO_MANY, field, f"must have at most {limit} items", actual)


def too_long(field: str, limit: int, unit: str = "bytes") -> FieldError:
    return FieldError(TOO_LONG, field, f"must have at most {limit} {unit}")


def not_supported(field: str, value: object, supported: list[str]) -> FieldError:
    values = ", ".join(json.dumps(v) for v in supported)
    return FieldError(NOT_SUPPORTED, field, f"supported values: {values}", value)


def forbidden(field: str, detail: str) -> FieldError:
    return FieldError(FORBIDDEN, field, detail)


def duplicate(field: str, value: object) -> FieldError:
    return FieldError(DUPLICATE, field, "", value)


def unknown_fields(errors: list[FieldError]) -> tuple[list[FieldError], list[FieldError]]:
    """Splits errors into (unknown-field errors, all others), for fieldValidation Strict/Warn/Ignore."""
    unknown = [e for e in errors if e.type == UNKNOWN_FIELD]
    return unknown, [e for e in errors if e.type != UNKNOWN_FIELD]


def strict_decoding_message(kind: str, version: str, errors: list[FieldError]) -> str:
    """The 400 BadRequest message of a real server under fieldValidation=Strict."""
    fields = ", ".join(f'unknown field "{e.field}"' for e in errors)
    return f'{kind} in version "{version}" cannot be handled as a {kind}: strict decoding error: {fields}'


def invalid_status(kind: str, name: str, errors: list[FieldError], group: str = "") -> dict[str, Any]:
    """The 422 Status the real server answers (apierrors.NewInvalid). `kind` may be `Kind.group`
    (e.g. `ResourceSlice.resource.k8s.io`) or a bare kind with `group` given separately."""
    if not group and "." in kind:
        kind, group = kind.split(".", 1)
    qualified = f"{kind}.{group}" if group else kind
    causes = [e.to_cause() for e in errors]
    if len(errors) == 1:
        summary = str(errors[0])
    else:
        summary = "[" + ", ".join(str(e) for e in errors) + "]"
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f'{qualified} "{name}" is invalid: {summary}',
        "reason": "Invalid",
        "details": _details(name, group, kind, causes),
        "code": 422,
    }


def _details(name: str, group: str, kind: str, causes: list[dict[str, Any]]) -> dict[str, Any]:
    details: dict[str, Any] = {"name": name}
    if group:  # StatusDetails.group is omitempty: absent for the core group
        details["group"] = group
    details["kind"] = kind
    details["causes"] = causes
    return details
