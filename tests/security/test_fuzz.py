"""Property-based tests of every decoder an outsider can reach: quantities, opaque configs (GpuConfig,
MigDeviceConfig, ComputeDomainChannelConfig), ResourceClaim bodies the preparer reads, every message of
the event catalog and every KV value as the bus decodes them, kubelet gRPC requests into the preparer
over its real socket, and ResourceClaim/ResourceSlice bodies through the embedded API server's validation.

Each property: no exception but the decoder's documented error type, a clear bounded message, and every
example done within hypothesis's deadline (1 s). `bench/fuzz_inputs.py` runs the same with more examples.
"""

from __future__ import annotations

import asyncio
import copy
from decimal import Decimal
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import grpc
import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from embedded.apiserver.validation import validate_object
from embedded.kubelet.client import Claim
from services.computedomain.channelcore import ChannelConfigError, parse_channel_config
from services.preparer.host.claims import ClaimDecodeError, ResourceClaim, decode_claim
from services.preparer.protos import dra_v1_pb2, dra_v1beta1_pb2
from shared.bus import Bus, TypedKV
from shared.claimconfigs import (
    ClaimConfigError,
    GpuConfig,
    MigDeviceConfig,
    RawConfig,
    decode_config,
    select,
)
from shared.events import catalog
from shared.quantity import MAX_LENGTH, MAX_VALUE, QuantityError, parse_quantity
from tests.preparer.helpers import (
    DRIVER,
    MemoryClaims,
    claim_doc,
    cleanup,
    gpu_config,
    running_node,
    short_root,
)
from tests.security.strategies import FUZZ, json_values, mutated, nesting, raw_json, shallow_json, shaped

MESSAGE_LIMIT = 1024  # the kubelet keeps 1024 characters of an error; ours say what is wrong well within it


# -- quantities ---------------------------------------------------------------------------------

_SUFFIXES: dict[str, int | Fraction]
_SUFFIXES = {
    "": 1,
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


@st.composite
def quantity_texts(draw: st.DrawFn) -> tuple[str, Fraction]:
    """A quantity in the upstream grammar and its value, computed independently (Decimal, small exponents)."""
    sign = draw(st.sampled_from(["", "+", "-"]))
    whole = draw(st.text("0123456789", max_size=22))
    fraction = draw(st.none() | st.text("0123456789", max_size=12))
    if not whole and not fraction:
        whole = "0"
    number = whole + ("." + fraction if fraction is not None else "")
    if draw(st.booleans()):
        exponent = draw(st.integers(min_value=-30, max_value=30))
        text, factor = f"{number}{draw(st.sampled_from('eE'))}{exponent}", Fraction(10) ** exponent
    else:
        suffix = draw(st.sampled_from(sorted(_SUFFIXES)))
        text, factor = number + suffix, Fraction(_SUFFIXES[suffix])
    value = Fraction(Decimal(number if number != "." else "0")) * factor
    return sign + text, -value if sign == "-" else value


@settings(**FUZZ)
@given(quantity_texts())
def test_quantities_in_the_grammar_parse_exactly_or_are_refused_for_a_limit(case: tuple[str, Fraction]) -> None:
    text, expected = case
    try:
        assert parse_quantity(text) == expected
    except QuantityError as exc:
        assert len(text) > MAX_LENGTH or abs(expected) > MAX_VALUE, f"{text!r} refused: {exc}"


@settings(**FUZZ)
@given(st.text(max_size=80) | st.text("0123456789.eE+-KMGTPEimnuk ", max_size=80) | st.integers() | st.none())
@example("0" * 21 + "\x1f" * 11 + "\x08" + "\U00011daa\U0001239a\U00018cd6" * 3)  # escapes once made the error long
def test_any_other_text_is_a_quantity_within_the_limits_or_a_clear_error(text: Any) -> None:
    try:
        value = parse_quantity(text)
    except QuantityError as exc:
        assert len(str(exc)) < 300
    else:
        assert isinstance(value, Fraction) and abs(value) <= MAX_VALUE


# -- opaque configs -----------------------------------------------------------------------------

VALID_CONFIGS = [
    gpu_config()["opaque"]["parameters"],
    gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})["opaque"]["parameters"],
    gpu_config(
        {
            "strategy": "MPS",
            "mpsConfig": {
                "defaultActiveThreadPercentage": 50,
                "defaultPinnedDeviceMemoryLimit": "10Gi",
                "defaultPerDevicePinnedMemoryLimit": {"0": "5Gi"},
            },
        }
    )["opaque"]["parameters"],
    gpu_config({"strategy": "TimeSlicing"}, kind="MigDeviceConfig")["opaque"]["parameters"],
]
configs = st.one_of(mutated(st.sampled_from(VALID_CONFIGS)), shaped(GpuConfig), shaped(MigDeviceConfig), json_values)


@settings(**FUZZ)
@given(configs)
def test_opaque_configs_decode_or_fail_with_a_config_error(parameters: Any) -> None:
    try:
        config = decode_config(parameters)
    except ClaimConfigError as exc:
        assert 0 < len(str(exc)) < MESSAGE_LIMIT
    else:
        assert isinstance(config, GpuConfig | MigDeviceConfig)


@settings(**FUZZ)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["FromClass", "FromClaim"]),
            st.lists(st.sampled_from(["gpu", "mig", "x"]), max_size=3),
            configs,
        ),
        max_size=4,
    )
)
def test_config_selection_for_a_claim_never_crashes(entries: list[tuple[str, list[str], Any]]) -> None:
    raw = [
        RawConfig(source=source, requests=requests, driver=DRIVER, parameters=parameters)
        for source, requests, parameters in entries
    ]
    try:
        groups = select(DRIVER, raw, [("gpu", "gpu"), ("mig/small", "mig")])
    except ClaimConfigError as exc:
        assert 0 < len(str(exc)) < MESSAGE_LIMIT
    else:
        assert sorted(i for g in groups for i in g.results) == [0, 1]


CHANNEL = {
    "apiVersion": "resource.nvidia.com/v1beta1",
    "kind": "ComputeDomainChannelConfig",
    "domainID": "6f1c0d5e-0000-4000-8000-000000000001",
    "allocationMode": "Single",
}


@settings(**FUZZ)
@given(mutated(st.just(CHANNEL)) | json_values | raw_json)
def test_channel_configs_decode_or_fail_with_a_channel_config_error(parameters: Any) -> None:
    if not isinstance(parameters, dict | bytes):
        parameters = msgspec.json.encode(parameters)
    try:
        parse_channel_config(parameters)
    except ChannelConfigError as exc:
        assert 0 < len(str(exc)) < MESSAGE_LIMIT


# -- ResourceClaim bodies the preparer reads ----------------------------------------------------

VALID_CLAIM = claim_doc(name="c", results=[("gpu", "gpu-0")], configs=[gpu_config({"strategy": "TimeSlicing"})])


@settings(**FUZZ)
@given(
    raw_json | mutated(st.just(VALID_CLAIM)).map(msgspec.json.encode) | shaped(ResourceClaim).map(msgspec.json.encode)
)
def test_claim_bodies_decode_or_fail_with_a_claim_decode_error(body: bytes) -> None:
    try:
        claim = decode_claim(body)
    except ClaimDecodeError as exc:
        assert 0 < len(str(exc)) < MESSAGE_LIMIT
    else:
        assert isinstance(claim, ResourceClaim)


# -- every event type and KV value, as the bus decodes them ------------------------------------

_BUS = object.__new__(Bus)  # the decode step only; no connection
_KV_BUS = SimpleNamespace(js=None, name="fuzz", spawn=lambda _: None, refuse=lambda *a: None)


def _bus_decode(message_type: Any, data: bytes) -> tuple[Any, str]:
    return _BUS._decode(msgspec.json.Decoder(message_type), SimpleNamespace(data=data))  # type: ignore[arg-type]


@pytest.mark.parametrize("entry", catalog.CATALOG, ids=lambda e: e.name)
def test_every_catalog_message_decodes_or_becomes_a_dead_letter_reason(entry: catalog.Entry) -> None:
    types = [entry.message] + ([entry.reply] if entry.reply is not None else [])

    @settings(**FUZZ, suppress_health_check=[HealthCheck.too_slow])
    @given(
        st.sampled_from(types).flatmap(
            lambda t: st.tuples(st.just(t), shallow_json | mutated(shaped(t)).map(msgspec.json.encode))
        )
    )
    def decodes(case: tuple[Any, bytes]) -> None:
        message_type, data = case
        message, error = _bus_decode(message_type, data)
        assert (isinstance(message, message_type) and error == "") or (message is None and error)

    decodes()


@pytest.mark.parametrize("bucket", catalog.BUCKETS, ids=lambda b: b.name)
def test_every_kv_value_decodes_or_is_skipped(bucket: catalog.Bucket) -> None:
    kv: TypedKV[Any] = TypedKV(_KV_BUS, bucket)

    @settings(**FUZZ, suppress_health_check=[HealthCheck.too_slow])
    @given(shallow_json | mutated(shaped(bucket.message)).map(msgspec.json.encode))
    def decodes(data: bytes) -> None:
        value = kv.decode("n1", data)
        assert value is None or isinstance(value, bucket.message)

    decodes()


@pytest.mark.parametrize("entry", [catalog.INVENTORY, catalog.CLAIM, catalog.DEAD_LETTER], ids=lambda e: e.name)
def test_an_event_nested_past_the_decoder_limit_becomes_a_dead_letter_reason(entry: catalog.Entry) -> None:
    message, error = _bus_decode(entry.message, nesting(3000))
    assert message is None and "nest" in error


def test_a_kv_value_nested_past_the_decoder_limit_is_skipped() -> None:
    kv: TypedKV[Any] = TypedKV(_KV_BUS, catalog.INVENTORY_BUCKET)
    assert kv.decode("n1", nesting(3000)) is None


# -- API bodies through the embedded API server's validation ------------------------------------

VALID_SLICE = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceSlice",
    "metadata": {"name": "n1-gpu"},
    "spec": {
        "driver": DRIVER,
        "nodeName": "n1",
        "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
        "devices": [
            {
                "name": "gpu-0",
                "attributes": {"productName": {"string": "H100"}},
                "capacity": {"memory": {"value": "80Gi"}},
            }
        ],
    },
}
API_CLAIM = {k: v for k, v in VALID_CLAIM.items() if k != "status"} | {
    "metadata": {"name": "c", "namespace": "default"}
}


@settings(**FUZZ)
@given(
    st.sampled_from(["ResourceClaim", "ResourceSlice"]).flatmap(
        lambda kind: st.tuples(
            st.just(kind), mutated(st.just(API_CLAIM if kind == "ResourceClaim" else VALID_SLICE)) | json_values
        )
    )
)
def test_api_bodies_validate_to_field_errors(case: tuple[str, Any]) -> None:
    kind, body = case
    errors = validate_object("resource.k8s.io", "v1", kind, copy.deepcopy(body))
    assert isinstance(errors, list)
    for error in errors:
        assert 0 < len(error.body()) < 4096


def test_the_unmutated_api_bodies_are_valid() -> None:  # so the mutations above start from a valid body
    assert validate_object("resource.k8s.io", "v1", "ResourceClaim", copy.deepcopy(API_CLAIM)) == []
    assert validate_object("resource.k8s.io", "v1", "ResourceSlice", copy.deepcopy(VALID_SLICE)) == []


# -- kubelet gRPC requests into the preparer over its real socket --------------------------------

claim_refs = st.lists(
    st.builds(Claim, namespace=st.text(max_size=30), uid=st.text(max_size=40), name=st.text(max_size=30)), max_size=5
)
request_bytes = st.one_of(
    st.binary(max_size=300),
    claim_refs.map(
        lambda cs: dra_v1_pb2.NodePrepareResourcesRequest(
            claims=[dra_v1_pb2.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in cs]
        ).SerializeToString()
    ),
)


async def test_grpc_requests_get_a_result_per_claim_or_a_grpc_error_and_the_socket_keeps_serving() -> None:
    root = short_root()
    claims = MemoryClaims()
    dev = root / "host" / "dev"
    dev.mkdir(parents=True)
    (dev / "nvidia0").touch()
    good = claims.add(claim_doc(name="good", results=[("gpu", "gpu-0")]))
    try:
        async with running_node(claims, root, dev_root=str(root / "host")) as node:
            loop = asyncio.get_running_loop()
            channel = node.plugin.channel
            methods: dict[tuple[str, str], grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]]
            methods = {
                (v, op): channel.unary_unary(f"/k8s.io.kubelet.pkg.apis.dra.{v}.DRAPlugin/{op}Resources")
                for v in ("v1", "v1beta1")
                for op in ("NodePrepare", "NodeUnprepare")
            }
            replies: dict[tuple[str, str], Any]  # four response classes, each with .claims
            replies = {
                ("v1", "NodePrepare"): dra_v1_pb2.NodePrepareResourcesResponse,
                ("v1", "NodeUnprepare"): dra_v1_pb2.NodeUnprepareResourcesResponse,
                ("v1beta1", "NodePrepare"): dra_v1beta1_pb2.NodePrepareResourcesResponse,
                ("v1beta1", "NodeUnprepare"): dra_v1beta1_pb2.NodeUnprepareResourcesResponse,
            }

            async def call(method: tuple[str, str], data: bytes) -> None:
                try:
                    raw = await methods[method](data, timeout=5)
                except grpc.aio.AioRpcError as exc:  # a request that is not a request: refused, nothing else
                    assert exc.code() in (
                        grpc.StatusCode.INTERNAL,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.UNKNOWN,
                    ), exc
                    return
                request = dra_v1_pb2.NodePrepareResourcesRequest.FromString(data)
                response = replies[method].FromString(raw)
                assert set(response.claims) == {c.uid for c in request.claims}
                for uid, entry in response.claims.items():
                    assert len(entry.error) < MESSAGE_LIMIT, uid

            @settings(**FUZZ, suppress_health_check=[HealthCheck.function_scoped_fixture])
            @given(st.sampled_from(sorted(methods)), request_bytes)
            def requests(method: tuple[str, str], data: bytes) -> None:
                asyncio.run_coroutine_threadsafe(call(method, data), loop).result(timeout=5)

            await asyncio.to_thread(requests)
            assert (await node.plugin.prepare([good]))[good.uid].error == ""  # the node still prepares
    finally:
        cleanup(root)
