"""The Kustomize overlays: they render, every object validates against the upstream Kubernetes
schemas (1.32 and 1.34), and the rendered objects have the properties the design promises
(least-privilege RBAC, pinned images, probes, requests, node mounts, production shape)."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest

from shared.natscreds import Issued, secrets_for
from shared.natsusers import all_users
from tests.deploy.conftest import (
    OVERLAYS,
    find,
    nats_users_module,
    render_overlay,
    render_overlay_v1beta1,
)

pytestmark = pytest.mark.kubectl

CLUSTER_SCOPED = {
    "Namespace",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "DeviceClass",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "ValidatingWebhookConfiguration",
}
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet"}
SLICE_WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection", "*"}


def _pod_specs(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(o["metadata"]["name"], o["spec"]["template"]["spec"]) for o in objects if o["kind"] in WORKLOADS]


def _containers(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{name}/{c['name']}", c) for name, spec in _pod_specs(objects) for c in spec["containers"]]


def _validate_all(objects: list[dict[str, Any]], version: str) -> list[str]:
    problems = []
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            problems.append(f"{where}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{where}: Kubernetes {version} has no {obj['apiVersion']} {obj['kind']}")
    return problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_every_object_kind(overlay: str) -> None:
    kinds = {o["kind"] for o in render_overlay(overlay)}
    expected = {
        "Namespace",
        "CustomResourceDefinition",
        "DeviceClass",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "ConfigMap",
        "Service",
        "StatefulSet",
        "DaemonSet",
        "Deployment",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    assert expected <= kinds, f"missing kinds: {sorted(expected - kinds)}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_against_kubernetes_1_34(overlay: str) -> None:
    assert _validate_all(render_overlay(overlay), "1.34.0") == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_with_v1beta1_component_validates_against_kubernetes_1_32(overlay: str) -> None:
    assert _validate_all(render_overlay_v1beta1(overlay), "1.32.0") == []


def test_v1_device_classes_do_not_exist_on_1_32_which_is_why_the_component_exists() -> None:
    problems = _validate_all(render_overlay("dev"), "1.32.0")
    assert problems and all("DeviceClass" in p and "has no resource.k8s.io/v1" in p for p in problems), problems


def test_validation_catches_a_broken_object() -> None:
    broken = find(render_overlay("dev"), "Deployment", "gpu-dra-publisher")
    broken = {**broken, "spec": {**broken["spec"], "replicas": "two"}}
    assert _validate_all([broken], "1.34.0"), "the validator accepted replicas: 'two'"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_namespaced_objects_live_in_gpu_dra(overlay: str) -> None:
    for obj in render_overlay(overlay):
        namespace = obj["metadata"].get("namespace")
        if obj["kind"] in CLUSTER_SCOPED:
            assert namespace is None, f"{obj['kind']}/{obj['metadata']['name']} is cluster-scoped"
        else:
            assert namespace == "gpu-dra", f"{obj['kind']}/{obj['metadata']['name']} in {namespace!r}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned_and_never_latest(overlay: str) -> None:
    for where, container in _containers(render_overlay(overlay)):
        image = container["image"]
        assert "@sha256:" in image or re.search(r":v?\d+\.\d+(\.\d+)?[\w.-]*$", image), f"{where}: {image} unpinned"
        assert not image.endswith(":latest"), f"{where}: {image}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_probes_requests_and_a_memory_limit(overlay: str) -> None:
    for where, container in _containers(render_overlay(overlay)):
        assert "livenessProbe" in container and "startupProbe" in container, where
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), where
        assert "memory" in container["resources"]["limits"], where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cluster_services_run_restricted(overlay: str) -> None:
    objects = render_overlay(overlay)
    for name in ("gpu-dra-publisher", "gpu-dra-controller", "gpu-dra-nats"):
        kind = "StatefulSet" if name == "gpu-dra-nats" else "Deployment"
        spec = find(objects, kind, name)["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] != 0, name
        for container in spec["containers"]:
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["readOnlyRootFilesystem"] is True, name
            assert ctx["capabilities"]["drop"] == ["ALL"], name


def _rules_by_service_account(objects: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    roles = {
        (o["kind"], o["metadata"]["name"]): o.get("rules", []) for o in objects if o["kind"] in ("Role", "ClusterRole")
    }
    out: dict[str, list[dict[str, Any]]] = {}
    for binding in objects:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        rules = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
        for subject in binding["subjects"]:
            if subject["kind"] == "ServiceAccount":
                out.setdefault(subject["name"], []).extend(rules)
    return out


def _can(rules: list[dict[str, Any]], group: str, resource: str, verbs: set[str]) -> set[str]:
    granted: set[str] = set()
    for rule in rules:
        if group in rule.get("apiGroups", []) or "*" in rule.get("apiGroups", []):
            if resource in rule.get("resources", []) or "*" in rule.get("resources", []):
                granted |= set(rule["verbs"]) & verbs
    return granted


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_publisher_may_write_resourceslices(overlay: str) -> None:
    rules = _rules_by_service_account(render_overlay(overlay))
    writers = {sa for sa, r in rules.items() if _can(r, "resource.k8s.io", "resourceslices", SLICE_WRITE_VERBS)}
    assert writers == {"gpu-dra-publisher"}
    assert not _can(rules["gpu-dra-node"], "resource.k8s.io", "resourceslices", SLICE_WRITE_VERBS)
    assert _can(rules["gpu-dra-node"], "resource.k8s.io", "resourceclaims", {"get"}) == {"get"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_service_account_may_read_secrets_or_escalate(overlay: str) -> None:
    for sa, rules in _rules_by_service_account(render_overlay(overlay)).items():
        for rule in rules:
            assert "*" not in rule["verbs"] and "*" not in rule.get("resources", []), (sa, rule)
            assert "secrets" not in rule.get("resources", []), (sa, rule)
            assert not {"bind", "escalate", "impersonate"} & set(rule["verbs"]), (sa, rule)


def test_node_agents_mount_the_kubelet_cdi_dev_and_driver_root_host_paths() -> None:
    ds = find(render_overlay("production"), "DaemonSet", "gpu-dra-node")
    spec = ds["spec"]["template"]["spec"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert set(host_paths.values()) >= {
        "/var/lib/kubelet/plugins",
        "/var/lib/kubelet/plugins_registry",
        "/var/run/cdi",
        "/dev",
        "/",
    }
    mounts = {c["name"]: {m["mountPath"]: m for m in c["volumeMounts"]} for c in spec["containers"]}
    assert set(mounts) == {"discovery", "preparer", "cd-agent"}
    assert {"/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/run/cdi"} <= set(mounts["preparer"])
    assert mounts["discovery"]["/driver-root"]["readOnly"] is True
    assert mounts["preparer"]["/driver-root"]["readOnly"] is True  # the driver userspace for claim CDI specs
    for name in ("discovery", "preparer"):
        env = {e["name"]: e.get("value") for e in next(c for c in spec["containers"] if c["name"] == name)["env"]}
        assert (env["GPU_DRA_DRIVER_ROOT"], env["GPU_DRA_CONTAINER_DRIVER_ROOT"]) == ("/", "/driver-root"), name
    # discovery has no API credentials at all; the others get the token through a projected volume
    assert spec["automountServiceAccountToken"] is False
    assert "/var/run/secrets/kubernetes.io/serviceaccount" not in mounts["discovery"]
    assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts["preparer"]


def test_node_agents_ask_the_auth_callout_for_their_node_role_with_a_projected_token() -> None:
    """No per-node files: the sentinel's creds (one Secret for all nodes), a projected token for
    audience nats, and the node role's identity asked for; no hostPath holds NATS credentials."""
    users = nats_users_module()
    spec = find(render_overlay("production"), "DaemonSet", "gpu-dra-node")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    token_sources = volumes["nats-token"]["projected"]["sources"]
    assert token_sources == [{"serviceAccountToken": {"path": "token", "audience": "nats", "expirationSeconds": 3600}}]
    assert volumes["nats-sentinel"]["secret"]["secretName"] == "gpu-dra-nats-sentinel"
    assert not any("nats" in v.get("hostPath", {}).get("path", "") for v in spec["volumes"])
    assert spec["serviceAccountName"] == "gpu-dra-node"
    roles = {"discovery": "discovery", "preparer": "preparer", "cd-agent": "cd-agent"}
    for container in spec["containers"]:
        role = roles[container["name"]]
        env = {e["name"]: e for e in container["env"]}
        assert env["GPU_DRA_NATS_USER"]["value"] == users.node_user(role, "$(GPU_DRA_NODE)")
        assert env["GPU_DRA_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        assert env["GPU_DRA_NATS_CREDS"]["value"] == "/etc/gpu-dra/nats/sentinel.creds"
        assert env["GPU_DRA_NATS_TOKEN_FILE"]["value"] == "/var/run/secrets/gpu-dra/nats/token"
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert (
            mounts["nats-sentinel"] == "/etc/gpu-dra/nats" and mounts["nats-token"] == "/var/run/secrets/gpu-dra/nats"
        )
    assert set(roles.values()) == set(users.NODE_ROLES)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_the_manifests_reference_are_the_ones_the_generator_writes(overlay: str) -> None:
    callout = {"user.creds": "x", "issuer.nk": "x", "account": "x", "auth-account": "x"}
    issued = Issued("", {name: "x" for name in all_users(["gpu-a"])}, "x", callout, "x")
    secrets: list[dict[str, Any]] = secrets_for(issued, ["gpu-a"], {})  # Secret manifests
    generated = {s["metadata"]["name"]: set(s["stringData"]) for s in secrets}
    referenced: dict[str, set[str]] = {}
    for _, spec in _pod_specs(render_overlay(overlay)):
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                keys = {item["key"] for item in volume["secret"].get("items", [])}
                referenced.setdefault(volume["secret"]["secretName"], set()).update(keys)
        for container in spec["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    referenced.setdefault(ref["name"], set()).add(ref["key"])
    referenced.pop("gpu-dra-webhook-tls", None)  # the webhook's certificate: cert-manager's (or yours), not NATS's
    for name, keys in referenced.items():
        assert name in generated, f"{name} is referenced but `gpu-dra nats credentials` does not write it"
        assert keys <= generated[name], f"{name}: keys {keys - generated[name]} not written"


def test_production_runs_a_three_member_nats_cluster_and_two_of_each_cluster_service() -> None:
    objects = render_overlay("production")
    nats = find(objects, "StatefulSet", "gpu-dra-nats")
    assert nats["spec"]["replicas"] == 3
    container = nats["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["-c", "/etc/nats/config/nats-cluster.conf"]
    env = [e["name"] for e in container["env"]]
    assert env.index("NATS_ROUTE_PASSWORD") < env.index("NATS_ROUTE_0"), "$(NATS_ROUTE_PASSWORD) must come first"
    assert {"NATS_ROUTE_0", "NATS_ROUTE_1", "NATS_ROUTE_2"} <= set(env)
    assert find(objects, "PodDisruptionBudget", "gpu-dra-nats")["spec"] == {
        "minAvailable": 2,
        "selector": nats["spec"]["selector"],
    }
    assert find(objects, "Deployment", "gpu-dra-publisher")["spec"]["replicas"] == 2
    controller = find(objects, "Deployment", "gpu-dra-controller")
    assert controller["spec"]["replicas"] == 2
    controller_env = {e["name"]: e.get("value") for e in controller["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert controller_env["GPU_DRA_LEADER_ELECTION"] == "true"


def test_dev_runs_one_nats_server_with_the_single_server_config() -> None:
    nats = find(render_overlay("dev"), "StatefulSet", "gpu-dra-nats")
    assert nats["spec"]["replicas"] == 1
    assert nats["spec"]["template"]["spec"]["containers"][0]["args"] == ["-c", "/etc/nats/config/nats.conf"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nats_config_map_carries_the_files_tested_here(overlay: str) -> None:
    from tests.deploy.conftest import NATS_DIR

    objects = render_overlay(overlay)
    config = next(
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("gpu-dra-nats-config")
    )
    for name, text in config["data"].items():
        assert text == (NATS_DIR / name).read_text(), name
    sts = find(objects, "StatefulSet", "gpu-dra-nats")
    names = [v["configMap"]["name"] for v in sts["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    assert names == [config["metadata"]["name"]], "the StatefulSet must mount the hashed ConfigMap"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_deny_ingress_by_default_and_open_nats_to_labelled_clients(overlay: str) -> None:
    objects = render_overlay(overlay)
    deny = find(objects, "NetworkPolicy", "gpu-dra-default-deny-ingress")["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress"]}
    nats_rules = find(objects, "NetworkPolicy", "gpu-dra-nats")["spec"]["ingress"]
    client_label = {"gpu-dra.nvidia.com/nats-client": "true"}
    assert nats_rules[0]["from"][0]["podSelector"]["matchLabels"] == client_label
    for name, _ in _pod_specs(objects):
        if name not in ("gpu-dra-nats", "gpu-dra-webhook"):  # the webhook speaks no NATS
            labels = next(o for o in objects if o["metadata"]["name"] == name and o["kind"] in WORKLOADS)
            assert labels["spec"]["template"]["metadata"]["labels"].items() >= client_label.items(), name


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"selector form not handled here: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_imex_between_node_agents_and_nothing_wider(overlay: str) -> None:
    objects = render_overlay(overlay)
    agent_labels = find(objects, "DaemonSet", "gpu-dra-node")["spec"]["template"]["metadata"]["labels"]
    imex_rules = []
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports", [])
            if any(p["port"] <= 50000 <= p.get("endPort", p["port"]) for p in ports):
                imex_rules.append((policy, rule))
    assert imex_rules, "no NetworkPolicy admits the IMEX port 50000"
    for policy, rule in imex_rules:
        assert _selects(policy["spec"]["podSelector"], agent_labels), "50000 must be open on node-agent pods only"
        assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "gpu-dra-node"}
        assert rule["ports"] == [{"protocol": "TCP", "port": 50000}]
        assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gpu-dra-node"}}}], (
            "only node-agent pods may dial the IMEX port (no namespaceSelector, no ipBlock)"
        )
        assert _selects(rule["from"][0]["podSelector"], agent_labels)


def test_the_node_agent_runs_the_real_imex_daemon_from_the_mounted_driver_root() -> None:
    from services.computedomain.config import AgentConfig
    from shared.config import config_from

    spec = find(render_overlay("production"), "DaemonSet", "gpu-dra-node")["spec"]["template"]["spec"]
    agent = next(c for c in spec["containers"] if c["name"] == "cd-agent")
    env = {e["name"]: e["value"] for e in agent["env"] if "value" in e}
    assert env["SERVICE_COMMAND"] == "computedomain agent"
    cfg = config_from(AgentConfig, {}, env={k: v for k, v in env.items() if k.startswith("GPU_DRA_")})
    assert cfg.imex_daemon == "real" and cfg.imex_command == "" and cfg.imex_check_command == "", (
        "the shipped agent must run nvidia-imex from the driver root, not the simulator or another command"
    )
    assert cfg.imex_peer_mode == "dns" and cfg.hosts_file == "/etc/hosts" and cfg.imex_server_port == 50000
    volumes = {v["name"]: v for v in spec["volumes"]}
    mount = next(m for m in agent["volumeMounts"] if m["mountPath"] == cfg.container_driver_root)
    assert mount["readOnly"] is True
    assert volumes[mount["name"]]["hostPath"]["path"] == cfg.driver_root
    assert {"name": "imex", "containerPort": 50000} in agent["ports"]
