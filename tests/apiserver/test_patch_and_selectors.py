"""Patch semantics (RFC 7386, RFC 6902, strategic merge with kubectl's directives) and the label
and field selector grammar, as pure functions."""

from __future__ import annotations

import pytest

from embedded.apiserver.patch import PatchError, json_patch, merge_patch, strategic_merge_patch
from embedded.apiserver.selectors import SelectorError, parse_field_selector, parse_label_selector


def test_merge_patch_rfc7386() -> None:
    target = {"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]}
    assert merge_patch(target, {"a": "z", "c": {"f": None}, "l": [3]}) == {"a": "z", "c": {"d": "e"}, "l": [3]}
    assert target["c"] == {"d": "e", "f": "g"}  # input untouched


def test_json_patch_operations_and_errors() -> None:
    doc = {"metadata": {"labels": {"a": "1"}}, "items": [1, 2, 3]}
    out = json_patch(
        doc,
        [
            {"op": "add", "path": "/metadata/labels/b", "value": "2"},
            {"op": "remove", "path": "/metadata/labels/a"},
            {"op": "replace", "path": "/items/0", "value": 9},
            {"op": "add", "path": "/items/-", "value": 4},
            {"op": "move", "from": "/items/1", "path": "/moved"},
            {"op": "copy", "from": "/moved", "path": "/copied"},
            {"op": "test", "path": "/copied", "value": 2},
        ],
    )
    assert out == {"metadata": {"labels": {"b": "2"}}, "items": [9, 3, 4], "moved": 2, "copied": 2}
    with pytest.raises(PatchError, match="missing"):
        json_patch(doc, [{"op": "remove", "path": "/nope"}])
    with pytest.raises(PatchError, match="testing value"):
        json_patch(doc, [{"op": "test", "path": "/items/0", "value": 7}])
    with pytest.raises(PatchError, match="list of operations"):
        json_patch(doc, {"op": "add"})


def test_strategic_merge_merges_keyed_lists_and_honours_directives() -> None:
    pod = {
        "spec": {
            "containers": [
                {"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}]},
                {"name": "b", "image": "y"},
            ]
        },
        "metadata": {"finalizers": ["f1"]},
    }
    out = strategic_merge_patch(
        pod,
        {
            "spec": {
                "containers": [
                    {"name": "a", "env": [{"name": "B", "value": "2"}]},
                    {"name": "b", "$patch": "delete"},
                    {"name": "c", "image": "z"},
                ]
            },
            "metadata": {"finalizers": ["f2"]},
        },
    )
    assert out["spec"]["containers"] == [
        {"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},
        {"name": "c", "image": "z"},
    ]
    assert out["metadata"]["finalizers"] == ["f1", "f2"]
    ordered = strategic_merge_patch(
        pod,
        {
            "spec": {
                "$setElementOrder/containers": [{"name": "b"}, {"name": "a"}],
                "containers": [{"name": "a", "image": "new"}],
            }
        },
    )
    assert [c["name"] for c in ordered["spec"]["containers"]] == ["b", "a"]
    replaced = strategic_merge_patch(pod, {"spec": {"$patch": "replace", "containers": []}})
    assert replaced["spec"] == {"containers": []}
    removed = strategic_merge_patch(pod, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["f1"]}})
    assert removed["metadata"]["finalizers"] == []
    retained = strategic_merge_patch(
        {"spec": {"strategy": {"type": "A", "rollingUpdate": {"x": 1}}}},
        {"spec": {"strategy": {"$retainKeys": ["type"], "type": "Recreate"}}},
    )
    assert retained["spec"]["strategy"] == {"type": "Recreate"}
    # Lists without a merge key are atomic, as upstream.
    assert strategic_merge_patch({"args": ["a", "b"]}, {"args": ["c"]}) == {"args": ["c"]}


def test_label_selector_grammar() -> None:
    def match(sel: str, labels: dict) -> bool:
        m = parse_label_selector(sel)
        assert m is not None
        return m({"metadata": {"labels": labels}})

    assert match("app=web,tier!=db", {"app": "web", "tier": "front"})
    assert not match("app==web", {"app": "api"})
    assert match("env in (prod, staging),!legacy", {"env": "staging"})
    assert not match("env notin (prod)", {"env": "prod"})
    assert match("gpu", {"gpu": "true"}) and not match("gpu", {})
    assert match("count>2", {"count": "3"}) and not match("count<2", {"count": "3"})
    assert match("example.com/team=a", {"example.com/team": "a"})
    assert parse_label_selector("") is None
    for bad in ("app in prod", "a=b c", "=x", "a>b"):
        with pytest.raises(SelectorError):
            parse_label_selector(bad)


def test_field_selector_grammar_and_allowed_fields() -> None:
    allowed = ("metadata.name", "metadata.namespace", "spec.nodeName", "spec.unschedulable")
    m = parse_field_selector("spec.nodeName=n1,metadata.name!=x", allowed, "Pod")
    assert m is not None
    assert m({"metadata": {"name": "p"}, "spec": {"nodeName": "n1"}})
    assert not m({"metadata": {"name": "x"}, "spec": {"nodeName": "n1"}})
    empty = parse_field_selector("spec.nodeName=", allowed, "Pod")
    assert empty is not None and empty({"spec": {}})
    unsched = parse_field_selector("spec.unschedulable=false", allowed, "Node")
    assert unsched is not None and unsched({"spec": {}})
    with pytest.raises(SelectorError, match=r"field label not supported: spec\.other"):
        parse_field_selector("spec.other=1", allowed, "Pod")
    with pytest.raises(SelectorError, match="invalid selector"):
        parse_field_selector("justaword", allowed, "Pod")
