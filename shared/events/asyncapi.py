"""The AsyncAPI 3.0 document of our events, generated from the one catalog (`gpu-dra events asyncapi`).

Written from the driver's side: events are operations the driver `send`s (a third party receives
them), device and ComputeDomain-agent requests are operations it `receive`s and replies to. Each
channel's address is the catalog's subject pattern with its tokens as parameters; JetStream streams
and KV buckets are named on the channels they capture (`x-gpu-dra-stream`, and a channel per KV
bucket's subjects). Every message carries the headers described by `EventHeaders`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from shared.events import cloudevents
from shared.events.catalog import BUCKETS, CATALOG, Entry, stream_of

VERSION = "1.0.0"

_TOKEN_DOCS = {
    "node": "The node's name (Kubernetes Node name): the publisher's identity for node-scoped subjects.",
    "namespace": "The claim's namespace.",
    "event": "The claim lifecycle step (prepare-started, prepared, prepare-failed, unprepared, rolled-back).",
    "device": "The device name (gpu-<minor> or a MIG device name).",
    "domain_uid": "The ComputeDomain's metadata.uid.",
    "identity": "The NATS identity of the consumer that filed the dead letter (dots as underscores).",
    "consumer": "The consumer's name.",
}

HEADERS: dict[str, Any] = {
    "type": "object",
    "description": "NATS headers on every event (CloudEvents NATS binding, binary mode, plus W3C trace context).",
    "properties": {
        "ce-specversion": {
            "type": "string",
            "const": cloudevents.SPEC_VERSION,
            "description": "CloudEvents spec version.",
        },
        "ce-id": {
            "type": "string",
            "description": "The event id (claim events: their event_id); unique per "
            "event, kept by a resend: de-duplicate on it.",
        },
        "ce-type": {"type": "string", "description": "com.nvidia.gpu.dra.<version>.<channel>."},
        "ce-source": {"type": "string", "description": "The publishing service, /gpu-dra/<service>."},
        "ce-subject": {"type": "string", "description": "The NATS subject the event was published on."},
        "ce-time": {
            "type": "string",
            "format": "date-time",
            "description": "When the producer observed it (RFC 3339, UTC).",
        },
        "content-type": {"type": "string", "const": cloudevents.CONTENT_TYPE, "description": "The body's media type."},
        "traceparent": {"type": "string", "description": "W3C trace context of the span that caused the event."},
        "tracestate": {"type": "string", "description": "W3C trace state, when the trace has one."},
        "Nats-Msg-Id": {"type": "string", "description": "JetStream de-duplication id (not for consumers: use ce-id)."},
    },
    "required": ["ce-specversion", "ce-id", "ce-type", "ce-source", "ce-subject", "ce-time", "content-type"],
}


def _address(subject: str) -> str:
    return subject  # the catalog's `{token}` is AsyncAPI's parameter syntax already


def _parameters(tokens: Sequence[str]) -> dict[str, Any]:
    return {t: {"description": _TOKEN_DOCS.get(t, t)} for t in tokens}


def _message(tp: type[msgspec.Struct], summary: str = "") -> dict[str, Any]:
    return {
        "name": tp.__name__,
        "title": tp.__name__,
        **({"summary": summary} if summary else {}),
        **({"description": tp.__doc__.strip()} if tp.__doc__ else {}),
        "contentType": cloudevents.CONTENT_TYPE,
        "headers": {"$ref": "#/components/schemas/EventHeaders"},
        "payload": {"$ref": f"#/components/schemas/{tp.__name__}"},
    }


def _entry_channel(entry: Entry) -> dict[str, Any]:
    channel: dict[str, Any] = {
        "address": _address(entry.subject),
        "title": entry.name,
        "summary": entry.summary,
        "messages": {entry.message.__name__: {"$ref": f"#/components/messages/{entry.message.__name__}"}},
    }
    if entry.tokens:
        channel["parameters"] = _parameters(entry.tokens)
    if entry.binds:
        channel["x-gpu-dra-binds"] = dict(entry.binds)
    stream = stream_of(entry.subject)
    if entry.pattern == "event" and stream is not None:
        channel["x-gpu-dra-stream"] = {"name": stream.name, "maxAgeSeconds": stream.max_age_s}
    return channel


def document() -> dict[str, Any]:
    """The AsyncAPI 3.0.0 document as a dict."""
    types: list[type[msgspec.Struct]] = []
    for entry in CATALOG:
        for tp in (entry.message, entry.reply):
            if tp is not None and tp not in types:
                types.append(tp)
    _, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    schemas: dict[str, Any] = {**components, "EventHeaders": HEADERS}
    messages: dict[str, Any] = {}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for entry in CATALOG:
        messages.setdefault(entry.message.__name__, _message(entry.message, entry.summary))
        channels[entry.name] = _entry_channel(entry)
        ref = {"$ref": f"#/channels/{entry.name}"}
        msg_ref = {"$ref": f"#/channels/{entry.name}/messages/{entry.message.__name__}"}
        if entry.pattern == "request" and entry.reply is not None:
            reply_name = f"{entry.name}-reply"
            messages.setdefault(entry.reply.__name__, _message(entry.reply))
            channels[reply_name] = {
                "address": None,  # the requester's inbox (NATS reply subject), dynamic
                "title": reply_name,
                "description": "The reply, sent to the requester's inbox.",
                "messages": {entry.reply.__name__: {"$ref": f"#/components/messages/{entry.reply.__name__}"}},
            }
            operations[entry.name] = {
                "action": "receive",
                "channel": ref,
                "summary": entry.summary,
                "messages": [msg_ref],
                "reply": {
                    "channel": {"$ref": f"#/channels/{reply_name}"},
                    "messages": [{"$ref": f"#/channels/{reply_name}/messages/{entry.reply.__name__}"}],
                },
            }
        else:
            operations[entry.name] = {"action": "send", "channel": ref, "summary": entry.summary, "messages": [msg_ref]}
    for bucket in BUCKETS:
        name = f"kv-{bucket.name}"
        key_tokens = [t.strip("{}") for t in bucket.key.split(".")] if bucket.key else []
        channels[name] = {
            "address": f"$KV.{bucket.name}." + ".".join(f"{{{t}}}" for t in key_tokens),
            "title": name,
            "summary": f"JetStream KV bucket {bucket.name}: the last value per key (history {bucket.history}).",
            "messages": {bucket.message.__name__: {"$ref": f"#/components/messages/{bucket.message.__name__}"}},
            "parameters": _parameters(key_tokens),
            "x-gpu-dra-kv": {"bucket": bucket.name, "key": bucket.key, "history": bucket.history},
        }
        messages.setdefault(bucket.message.__name__, _message(bucket.message))
        operations[name] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{name}"},
            "summary": f"Values written to KV bucket {bucket.name}.",
            "messages": [{"$ref": f"#/channels/{name}/messages/{bucket.message.__name__}"}],
        }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "gpu-dra events",
            "version": VERSION,
            "description": "Events and requests of the NVIDIA GPU DRA driver on NATS. Subjects `dra.v1....` are "
            "additive-only; breaking changes come as `dra.v2....` published beside v1 for a "
            "release (docs/events.md). Every field is always present on the wire.",
            "license": {"name": "Apache-2.0"},
        },
        "defaultContentType": cloudevents.CONTENT_TYPE,
        "servers": {
            "nats": {
                "host": "localhost:4222",
                "protocol": "nats",
                "description": "The cluster's NATS (JetStream on); `gpu-dra up` writes its URL and a "
                "reader credential into its data dir.",
            },
        },
        "channels": channels,
        "operations": operations,
        "components": {"schemas": schemas, "messages": messages},
    }
