"""Hypothesis strategies for the fuzz tests: arbitrary JSON, documents shaped like a msgspec type
(derived from the type itself, so a new field is fuzzed without touching the tests), and mutations
of a valid document (one value anywhere replaced by arbitrary JSON, or deleted)."""

from __future__ import annotations

import copy
import os
from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import strategies as st

# Every example well under 1 s, the suite under a minute; bench/fuzz_inputs.py raises the count.
FUZZ: dict[str, Any] = {"max_examples": int(os.environ.get("GPU_DRA_FUZZ_EXAMPLES", "200")), "deadline": 1000}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["1e999999", "1e30Gi", "-0", "9" * 70, "\u0000", "Default", "MPS", "TimeSlicing"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=20,
)


def nesting(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


shallow_json = st.one_of(st.binary(max_size=200), json_values.map(lambda v: msgspec.json.encode(v)))
deep_json = st.one_of(  # past msgspec's 1000-level limit: a RecursionError unless the decoder catches it
    st.integers(min_value=100, max_value=5000).map(lambda d: b"[" * d + b"]" * d),
    st.integers(min_value=100, max_value=5000).map(nesting),
)
raw_json = shallow_json | deep_json


def _for(info: mi.Type, seen: tuple[type, ...] = ()) -> st.SearchStrategy[Any]:
    if isinstance(info, mi.StructType):
        if info.cls in seen:
            return st.none()
        required = {f.encode_name: _for(f.type, (*seen, info.cls)) for f in info.fields if f.required}
        optional = {f.encode_name: _for(f.type, (*seen, info.cls)) for f in info.fields if not f.required}
        return st.fixed_dictionaries(required, optional=optional)
    if isinstance(info, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType):
        return st.lists(_for(info.item_type, seen), max_size=3)
    if isinstance(info, mi.DictType):
        return st.dictionaries(st.text(max_size=12), _for(info.value_type, seen), max_size=3)
    if isinstance(info, mi.UnionType):
        return st.one_of(*(_for(t, seen) for t in info.types))
    if isinstance(info, mi.LiteralType):
        return st.sampled_from(list(info.values))
    if isinstance(info, mi.IntType):
        return st.integers(min_value=-(2**63), max_value=2**64 - 1)
    if isinstance(info, mi.FloatType):
        return st.floats(allow_nan=False, allow_infinity=False)
    if isinstance(info, mi.StrType):
        return st.text(max_size=20)
    if isinstance(info, mi.BoolType):
        return st.booleans()
    if isinstance(info, mi.NoneType):
        return st.none()
    return json_values


def shaped(cls: Any) -> st.SearchStrategy[Any]:
    """Documents shaped like `cls` (a msgspec type), most of them valid."""
    return _for(mi.type_info(cls))


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            out += _paths(value, (*prefix, index))
    return out


@st.composite
def mutated(draw: st.DrawFn, docs: st.SearchStrategy[Any]) -> Any:
    """A document from `docs` with one value (anywhere, the root included) replaced by arbitrary JSON or deleted."""
    doc = copy.deepcopy(draw(docs))
    path = draw(st.sampled_from(_paths(doc)))
    replacement = draw(json_values)
    if not path:
        return replacement
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    return doc
