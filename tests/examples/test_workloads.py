"""The sample workloads in examples/workloads/ are valid Kubernetes objects that fit together.

Each manifest is checked against the upstream OpenAPI schemas (kubernetes-validate, strict), its
opaque configs are decoded by the preparer's own strict decoder, and every claim reference a pod
(or pod template) makes resolves to an object in the same file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from embedded.cluster.demo import EXPECT_PENDING
from shared import nodeconfig
from shared.claimconfigs import decode_config, strategy

WORKLOADS = Path(__file__).resolve().parents[2] / "examples" / "workloads"
K8S_VERSION = "1.34.0"
NVIDIA_CLASSES = {"gpu.nvidia.com", "mig.nvidia.com"}
EXPECTED = {"full-gpu", "shared-containers", "shared-pods", "mig-static", "time-slicing", "mps", "tenant-shares"}


def manifests() -> list[Path]:
    return sorted(WORKLOADS.glob("*.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "Pod":
        return [doc["spec"]]
    if doc["kind"] in ("Deployment", "ReplicaSet", "Job"):
        return [doc["spec"]["template"]["spec"]]
    return []


def key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["metadata"].get("namespace", ""), doc["metadata"]["name"]


def claim_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "ResourceClaim":
        return [doc["spec"]]
    if doc["kind"] == "ResourceClaimTemplate":
        return [doc["spec"]["spec"]]
    return []


def test_every_promised_workload_is_there() -> None:
    assert {p.stem for p in manifests()} == EXPECTED


@pytest.mark.parametrize("path", manifests(), ids=lambda p: p.stem)
def test_manifest_is_valid_against_the_kubernetes_schemas(path: Path) -> None:
    docs = documents(path)
    assert docs, f"{path.name} holds no objects"
    for doc in docs:
        if doc["kind"] == nodeconfig.KIND:  # our CRD's object: the publisher's own strict decoder checks it
            nodeconfig.from_obj(doc)
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata'].get('name')}: {exc.message} at {list(exc.path)}")
        if doc["apiVersion"].startswith("resource.k8s.io"):
            assert doc["apiVersion"] == "resource.k8s.io/v1", f"{path.name}: use resource.k8s.io/v1"


@pytest.mark.parametrize("path", manifests(), ids=lambda p: p.stem)
def test_pods_reference_claims_and_requests_that_exist(path: Path) -> None:
    docs = documents(path)
    namespaces = {d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"}
    # a namespace of its own, or one per tenant when the sample is about tenants
    assert len(namespaces) == 1 or path.stem.startswith("tenant"), f"{path.name}: one namespace of its own"
    claims = {key(d): claim_specs(d)[0] for d in docs if d["kind"] == "ResourceClaim"}
    templates = {key(d): claim_specs(d)[0] for d in docs if d["kind"] == "ResourceClaimTemplate"}
    workloads = [d for d in docs if pod_specs(d)]
    assert workloads, f"{path.name} runs nothing"
    for doc in docs:
        if doc["kind"] not in ("Namespace", nodeconfig.KIND):
            assert doc["metadata"]["namespace"] in namespaces, f"{doc['kind']} outside {namespaces}"
    for doc in workloads:
        ns = doc["metadata"]["namespace"]
        for spec in pod_specs(doc):
            pod_claims: dict[str, dict[str, Any]] = {}
            for ref in spec["resourceClaims"]:
                if "resourceClaimName" in ref:
                    name = ref["resourceClaimName"]
                    assert (ns, name) in claims, f"no ResourceClaim {name} in {ns}"
                    pod_claims[ref["name"]] = claims[(ns, name)]
                else:
                    name = ref["resourceClaimTemplateName"]
                    assert (ns, name) in templates, f"no ResourceClaimTemplate {name} in {ns}"
                    pod_claims[ref["name"]] = templates[(ns, name)]
            for container in spec["containers"]:
                for use in container["resources"]["claims"]:
                    assert use["name"] in pod_claims, f"container {container['name']} names unknown claim"
                    requests = {r["name"] for r in pod_claims[use["name"]]["devices"]["requests"]}
                    if "request" in use:
                        assert use["request"] in requests, f"container {container['name']}: no request {use['request']}"
    for spec in [*claims.values(), *templates.values()]:
        for request in spec["devices"]["requests"]:
            assert request["exactly"]["deviceClassName"] in NVIDIA_CLASSES


def opaque_configs(path: Path) -> list[tuple[list[str], dict[str, Any]]]:
    out = []
    for doc in documents(path):
        for spec in claim_specs(doc):
            for config in spec["devices"].get("config", []):
                assert config["opaque"]["driver"] == "gpu.nvidia.com"
                out.append((config.get("requests", []), config["opaque"]["parameters"]))
    return out


@pytest.mark.parametrize(("stem", "expected"), [("time-slicing", "TimeSlicing"), ("mps", "MPS")])
def test_sharing_configs_decode_with_the_preparers_strict_decoder(stem: str, expected: str) -> None:
    configs = opaque_configs(WORKLOADS / f"{stem}.yaml")
    assert len(configs) == 1
    requests, parameters = configs[0]
    decoded = decode_config(parameters)
    assert strategy(decoded) == expected
    assert requests, "a sharing config should name the request it applies to"


def test_a_typo_in_a_sample_config_would_be_caught() -> None:
    _, parameters = opaque_configs(WORKLOADS / "mps.yaml")[0]
    broken = {**parameters, "sharing": {**parameters["sharing"], "mpsConfg": {}}}
    with pytest.raises(ValueError, match="mpsConfg"):
        decode_config(broken)


def test_shared_pods_sample_shares_one_named_claim_between_replicas() -> None:
    docs = documents(WORKLOADS / "shared-pods.yaml")
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 2
    (ref,) = deployment["spec"]["template"]["spec"]["resourceClaims"]
    assert "resourceClaimName" in ref, "pods of a Deployment share a claim only through resourceClaimName"


def test_mig_sample_keeps_its_devices_on_one_parent() -> None:
    (template,) = [d for d in documents(WORKLOADS / "mig-static.yaml") if d["kind"] == "ResourceClaimTemplate"]
    devices = template["spec"]["spec"]["devices"]
    assert {r["exactly"]["deviceClassName"] for r in devices["requests"]} == {"mig.nvidia.com"}
    assert devices["constraints"] == [{"requests": [], "matchAttribute": "gpu.nvidia.com/parentUUID"}]


def test_tenant_shares_sample_shares_one_gpu_model_on_one_node_among_tenants() -> None:
    """Three tenants, a claim each in its own namespace asking its own amounts; the NodeConfig turns only
    gpu-node-0's L40S into MPS shares (every other GPU of the demo stays as the other samples need it)."""
    docs = documents(WORKLOADS / "tenant-shares.yaml")
    (config,) = [nodeconfig.from_obj(d) for d in docs if d["kind"] == nodeconfig.KIND]
    (rule,) = config.spec.rules
    assert rule.sharing == "mpsShares" and rule.gpus is not None and rule.gpus.productName == "NVIDIA L40S"
    assert rule.nodeSelector is not None and rule.nodeSelector.matchLabels == {"kubernetes.io/hostname": "gpu-node-0"}
    claims = [d for d in docs if d["kind"] == "ResourceClaim"]
    assert len({c["metadata"]["namespace"] for c in claims}) == len(claims) == 4
    memory = {}
    for c in claims:
        (request,) = c["spec"]["devices"]["requests"]
        assert set(request["exactly"]["capacity"]["requests"]) == {"memory", "compute"}
        memory[c["metadata"]["namespace"]] = int(
            request["exactly"]["capacity"]["requests"]["memory"].removesuffix("Gi")
        )
    # the fourth asks for more than the L40S's 48Gi less the other three's: its pod says so and stays Pending
    (held,) = [d for d in docs if d["kind"] == "Pod" and d["metadata"].get("annotations")]
    assert held["metadata"]["namespace"] == "tenant-d" and 48 - sum(memory.values()) + memory["tenant-d"] < 24
    assert held["metadata"]["annotations"] == {EXPECT_PENDING: "memory 16Gi of 48Gi left, request needs 24Gi"}
