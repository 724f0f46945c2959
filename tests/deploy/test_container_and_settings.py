"""Lint-style checks of what cannot be run here: the Dockerfile (no Docker engine on these
machines), the OpenTelemetry Collector example, and that every GPU_DRA_* variable the
manifests set is a setting the service actually has (an unknown one stops a service at start)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from shared.config import ENV_PREFIX, LAUNCHER_ENV, CommonConfig
from tests.deploy.conftest import DEPLOY, REPO, render_overlay

DOCKERFILE = DEPLOY / "container" / "Dockerfile"


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _resolve(image: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), image)


def test_dockerfile_is_multi_stage_on_a_pinned_base() -> None:
    steps = _instructions(DOCKERFILE.read_text())
    args = dict(a.split("=", 1) for kind, a in steps if kind == "ARG" and "=" in a)
    froms = [_resolve(a.split()[0], args) for kind, a in steps if kind == "FROM"]
    assert len(froms) >= 2, "build and runtime stages"
    for image in froms:
        assert "@sha256:" in image or re.search(r":\d+\.\d+\.\d+[\w.-]*$", image), f"base {image} is not pinned"
        assert not image.endswith(":latest") and ":" in image, image
    assert any(kind == "COPY" and a.startswith("--from=build") for kind, a in steps), "runtime copies from build"


def test_dockerfile_runs_as_a_numeric_non_root_user_last() -> None:
    steps = _instructions(DOCKERFILE.read_text())
    users = [a for kind, a in steps if kind == "USER"]
    assert users, "no USER"
    user = users[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, f"final USER {users[-1]} must be a numeric non-root uid"
    last_from = max(i for i, (kind, _) in enumerate(steps) if kind == "FROM")
    assert any(kind == "USER" for kind, _ in steps[last_from:]), "USER must be set in the runtime stage"
    assert any(kind == "ENTRYPOINT" and "gpu-dra" in a for kind, a in steps)


def test_dockerfile_health_is_documented_as_kubernetes_probes() -> None:
    steps = _instructions(DOCKERFILE.read_text())
    assert any(kind == "HEALTHCHECK" for kind, _ in steps)
    assert "probes" in DOCKERFILE.read_text()
    assert "Probes" in (REPO / "docs" / "operations.md").read_text()


def test_dockerfile_copies_the_services_and_not_the_local_cluster_world() -> None:
    steps = _instructions(DOCKERFILE.read_text())
    copied = {a.split()[0] for kind, a in steps if kind == "COPY" and not a.startswith("--")}
    assert {"shared", "services", "pyproject.toml"} <= copied
    assert "embedded" not in copied and "tests" not in copied and "." not in copied, copied
    installs = [a for kind, a in steps if kind == "RUN" and "pip install" in a]
    assert installs and all("[" not in a.split("pip install", 1)[1].split("&&")[0] for a in installs), (
        "the image installs no extra (dev, embedded)"
    )


_IMPORTERS = {"import_module", "find_spec", "__import__"}


def _imported(source: str) -> set[str]:
    """The top-level packages `source` imports: import statements, and a module named to importlib by a literal."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in _IMPORTERS and isinstance(node.args[0].value, str):
                found.add(node.args[0].value.split(".")[0])
    return found


def _imports(root: Path) -> set[tuple[str, str]]:
    return {(str(path.relative_to(REPO)), m) for path in root.rglob("*.py") for m in _imported(path.read_text())}


def test_the_import_scan_sees_a_module_named_to_importlib() -> None:
    source = "import importlib, importlib.util\nfrom a.b import c\nimportlib.import_module('embedded.x')\n"
    source += "importlib.util.find_spec('cel')\n__import__('tests.y')\nprint('embedded')\n"
    assert _imported(source) == {"importlib", "a", "embedded", "cel", "tests"}


def test_what_the_image_ships_needs_neither_embedded_nor_its_extra_nor_test_helpers() -> None:
    shipped = _imports(REPO / "shared") | _imports(REPO / "services")
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["embedded"]
    assert {"kubernetes-validate", "common-expression-language"} <= {re.split(r"[<>=]", r)[0] for r in extra}
    forbidden = {"embedded", "tests", "kubernetes_validate", "cel", "pytest"}
    assert sorted((f, m) for f, m in shipped if m in forbidden) == []
    helpers = [p for root in ("shared", "services") for p in (REPO / root).rglob("testing.py")]
    assert helpers == [], "test helpers live under embedded/harness or tests/"


def test_a_local_cluster_command_without_the_embedded_world_names_the_extra() -> None:
    code = "import sys; sys.modules['embedded'] = None; from shared.cli import main; sys.exit(main(['up']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2
    assert "pip install 'gpu-dra[embedded]'" in done.stderr, done.stderr


def test_otel_collector_pipelines_use_only_defined_components() -> None:
    config = yaml.safe_load((DEPLOY / "otel" / "collector.yaml").read_text())
    pipelines = config["service"]["pipelines"]
    assert {"traces", "metrics"} <= set(pipelines)
    for name, pipeline in pipelines.items():
        for section in ("receivers", "processors", "exporters"):
            for component in pipeline.get(section, []):
                assert component in config[section], f"pipeline {name} uses undefined {section[:-1]} {component}"
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318"), "services speak OTLP/HTTP"
    assert set(config["service"]["extensions"]) <= set(config["extensions"])


# --- GPU_DRA_* settings the manifests set --------------------------------------------------

SERVICE_CONFIG_MODULES = {
    "discovery": ["services.discovery.config"],
    "preparer": ["services.preparer.config"],
    "publisher": ["services.publisher.config"],
    "computedomain": ["services.computedomain.config"],
    "webhook": ["services.webhook.config"],
}


def _command(container: dict[str, Any]) -> list[str]:
    env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
    if "SERVICE_COMMAND" in env:
        return shlex.split(env["SERVICE_COMMAND"])
    return list(container.get("args", []))


def _settings(service: str) -> set[str] | None:
    """Every GPU_DRA_* name some config class of the service accepts; None if not written yet."""
    names: set[str] = set()
    found = False
    for module_name in SERVICE_CONFIG_MODULES[service]:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, CommonConfig):
                found = True
                names |= {ENV_PREFIX + f.name.upper() for f in msgspec.structs.fields(cls)}
    return names if found else None


def _gpu_dra_containers() -> list[tuple[str, str, set[str]]]:
    out = []
    seen = set()
    for overlay in ("dev", "production"):
        for obj in render_overlay(overlay):
            if obj["kind"] not in ("Deployment", "DaemonSet"):
                continue
            for container in obj["spec"]["template"]["spec"]["containers"]:
                service = _command(container)[0]
                env = {e["name"] for e in container.get("env", [])} | set()
                key = (overlay, obj["metadata"]["name"], container["name"])
                if key not in seen:
                    seen.add(key)
                    out.append((f"{overlay}:{obj['metadata']['name']}/{container['name']}", service, env))
    return out


@pytest.mark.parametrize("service", sorted(SERVICE_CONFIG_MODULES))
def test_manifests_set_only_settings_the_service_has(service: str) -> None:
    known = _settings(service)
    if known is None:
        pytest.skip(f"{SERVICE_CONFIG_MODULES[service]} not written yet: cannot check the manifests' GPU_DRA_* names")
    checked = 0
    for where, svc, env in _gpu_dra_containers():
        if svc != service:
            continue
        checked += 1
        unknown = sorted(n for n in env if n.startswith(ENV_PREFIX) and n not in known | LAUNCHER_ENV)
        assert unknown == [], f"{where} sets {unknown}, which `gpu-dra {service}` rejects at start"
    assert checked, f"no container runs gpu-dra {service}"
