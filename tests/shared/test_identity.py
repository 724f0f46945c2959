"""The identity rules the bus applies (shared/identity.py), from the catalog's binds: pure checks.
The same rules end to end, on the shipped NATS users, are in tests/security/."""

from __future__ import annotations

from shared.events import catalog
from shared.events.claims import ClaimLifecycle, claim_event_id, event_id_node
from shared.events.computedomain import DomainMember
from shared.events.health import DeviceHealth
from shared.events.inventory import NodeInventory
from shared.identity import check_event, check_kv


def inventory(node: str) -> NodeInventory:
    return NodeInventory(node=node, driver_version="550.0.0", cuda_driver_version="12.4.0")


def claim(node: str = "gpu-a", namespace: str = "team-a", event_id: str = "") -> ClaimLifecycle:
    return ClaimLifecycle(
        event="prepared",
        node=node,
        driver="gpu.nvidia.com",
        claim_uid="u1",
        claim_namespace=namespace,
        claim_name="c",
        event_id=event_id,
    )


def test_every_event_whose_subject_names_a_node_namespace_or_domain_binds_it_to_the_body() -> None:
    for entry in catalog.CATALOG:
        if entry.pattern != "event" or entry is catalog.DEAD_LETTER:
            continue
        bound = {token for token, _field in entry.binds}
        assert {"node", "namespace", "domain_uid"} & set(entry.tokens) <= bound, entry.name
        for _token, field in entry.binds:
            assert field in entry.message.__struct_fields__, (entry.name, field)
    for bucket in catalog.BUCKETS:
        for _token, field in bucket.binds:
            assert field in bucket.message.__struct_fields__, (bucket.name, field)


def test_a_body_naming_another_node_than_its_subject_is_a_mismatch() -> None:
    subject = catalog.INVENTORY.format(node="gpu-a")
    assert check_event(catalog.INVENTORY, subject, inventory("gpu-a")) is None
    mismatch = check_event(catalog.INVENTORY, subject, inventory("gpu-b"))
    assert mismatch is not None and mismatch.fields == (("node", "gpu-a", "gpu-b"),)
    assert "identity-mismatch" in mismatch.error and "gpu-b" in mismatch.error
    # a subject that is not of the entry's shape speaks for nobody
    assert check_event(catalog.INVENTORY, "dra.v1.inventory.gpu-a.extra", inventory("gpu-a")) is not None


def test_claim_events_bind_namespace_node_and_the_event_ids_node() -> None:
    subject = catalog.CLAIM.format(namespace="team-a", node="gpu-a", event="prepared")
    assert check_event(catalog.CLAIM, subject, claim(event_id=claim_event_id("gpu-a", "u1", 1, "prepared"))) is None
    assert check_event(catalog.CLAIM, subject, claim(event_id="u1/prepared/1")) is None  # the older id shape
    for wrong in (
        claim(namespace="team-b"),
        claim(node="gpu-b"),
        claim(event_id=claim_event_id("gpu-b", "u1", 1, "prepared")),
        claim(event_id="a/b"),
    ):
        assert check_event(catalog.CLAIM, subject, wrong) is not None, wrong
    assert event_id_node("gpu-a/u1/prepared/3") == "gpu-a"
    assert event_id_node("u1/prepared/3") == "" and event_id_node("") == ""
    assert event_id_node("x//y/z") is None


def test_kv_keys_bind_values_including_dotted_device_names_and_skip_other_key_shapes() -> None:
    mig = "gpu-0-mig-1g.10gb-19-0"
    healthy = DeviceHealth(node="gpu-a", device=mig, state="Healthy")
    assert check_kv(catalog.HEALTH_BUCKET, f"gpu-a.{mig}", healthy) is None
    assert (
        check_kv(catalog.HEALTH_BUCKET, f"gpu-a.{mig}", DeviceHealth(node="gpu-b", device=mig, state="Healthy"))
        is not None
    )
    assert check_kv(catalog.HEALTH_BUCKET, "gpu-a.gpu-1", healthy) is not None
    assert check_kv(catalog.INVENTORY_BUCKET, "gpu-a", inventory("gpu-b")) is not None
    member = DomainMember(
        domain_uid="cd-1",
        domain_name="d",
        domain_namespace="ns",
        node="gpu-b",
        ip_address="10.0.0.1",
        clique_id="c",
        index=0,
    )
    assert check_kv(catalog.CD_MEMBERS_BUCKET, "cd-1.gpu-a", member) is not None
    assert check_kv(catalog.CD_MEMBERS_BUCKET, "cd-1.gpu-b", member) is None
    # index bids (`<uid>.idx.<clique>.<n>.<node>`) are not membership keys: NATS permissions decide their writers
    assert check_kv(catalog.CD_MEMBERS_BUCKET, "cd-1.idx.c.00.gpu-a", member) is None
