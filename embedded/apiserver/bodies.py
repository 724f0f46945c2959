"""Request bodies into plain values: JSON, YAML and protobuf (custom resources in JSON only), with the
nesting every later step can follow.

Owns the one limit on how deeply a body's objects and arrays may nest (MAX_DEPTH). kube-apiserver's
JSON decoder refuses bodies nested past 10000 levels with `400 BadRequest` ("exceeded max depth");
this server's steps after decoding (validation, patches, pruning, encodings) walk objects recursively in
Python, so it refuses past MAX_DEPTH, with the same status and reason, before any of them runs: a 5000-level
body is a 400 naming the limit, never a RecursionError's 500, and nothing is stored. Protobuf bodies pass
through `checked` once decoded (a RawExtension holds JSON of its own).
"""

from __future__ import annotations

from typing import Any

import msgspec
import yaml
from aiohttp import web

from embedded.apiserver import errors, protobuf

MAX_DEPTH = 200  # objects and arrays inside one another; a CRD with a pod template's schema nests ~40


def too_deep() -> errors.ApiError:
    return errors.bad_request(
        f"json parse error: exceeded max depth: the request body nests objects and arrays "
        f"more than {MAX_DEPTH} levels deep"
    )


def decode_json(raw: bytes, what: str = "the request body is not valid JSON") -> Any:
    """`raw` decoded; 400 (`what: <decoder error>`) when it is not JSON or nests deeper than MAX_DEPTH."""
    try:
        value = msgspec.json.decode(raw)
    except RecursionError:  # msgspec follows nesting on the C stack, up to Python's recursion limit
        raise too_deep() from None
    except msgspec.DecodeError as exc:
        raise errors.bad_request(f"{what}: {exc}") from exc
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:  # fewer brackets than the limit cannot nest past it
        checked(value)
    return value


def decode_yaml(raw: bytes, what: str = "error decoding YAML") -> Any:
    """`raw` as YAML (JSON is YAML); 400 as `decode_json` says."""
    try:
        value = yaml.safe_load(raw)
    except RecursionError:
        raise too_deep() from None
    except yaml.YAMLError as exc:
        raise errors.bad_request(f"{what}: {exc}") from exc
    return checked(value)


def checked(value: Any) -> Any:
    """`value` itself, once its nesting is found within MAX_DEPTH (walked without recursion; a YAML
    alias's shared node is walked again only when reached deeper than before)."""
    deepest: dict[int, int] = {}
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > MAX_DEPTH:
            raise too_deep()
        if deepest.get(id(node), 0) >= depth:
            continue
        deepest[id(node)] = depth
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return value


def decode_protobuf(raw: bytes, default: tuple[str, str]) -> dict[str, Any]:
    """A protobuf body -> its JSON object; 415 for a kind with no protobuf form, 400 when malformed."""
    try:
        return protobuf.decode_body(raw, default)
    except RecursionError:  # a RawExtension's JSON nested past what the decoder follows
        raise too_deep() from None
    except protobuf.UnknownKind as exc:
        raise errors.ApiError(415, "UnsupportedMediaType", str(exc)) from exc
    except protobuf.ProtobufError as exc:
        raise errors.bad_request(f"the request body could not be decoded as protobuf: {exc}") from exc


def json_only(request: web.Request) -> None:
    """Custom resources are served in JSON only, as upstream: 415 for a protobuf body, 406 when the
    client accepts nothing else (`Accept: application/vnd.kubernetes.protobuf, */*` gets JSON)."""
    if request.headers.get("Content-Type", "").split(";")[0].strip() == protobuf.MEDIA_TYPE:
        raise errors.ApiError(
            415,
            "UnsupportedMediaType",
            "the body of the request was in an unknown format - "
            "accepted media types include: application/json, application/yaml",
        )
    if not protobuf.accepts_json(request.headers.get("Accept", "")):
        raise errors.ApiError(
            406, "NotAcceptable", "only the following media types are accepted: application/json, application/yaml"
        )
