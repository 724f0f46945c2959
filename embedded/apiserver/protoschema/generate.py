"""Write table.py, the protobuf schema of the built-in kinds, from upstream sources.

    python -m embedded.apiserver.protoschema.generate API_REPO APIMACHINERY_REPO

API_REPO and APIMACHINERY_REPO are git repositories (a clone or a bare mirror) of k8s.io/api and
k8s.io/apimachinery; the files are read at HEAD with `git show`. The structure (messages, field
numbers, types, repeated, map) comes from each package's generated.proto; the Go types.go of the
same package adds what the .proto does not say: the JSON name (`json:"..."` tag), whether a field
is embedded (`json:""`, its fields inlined in JSON), and whether a zero value is kept in JSON
(a pointer, or a field without omitempty). Only the messages reachable from ROOTS are written.
Not run by the tests; the generated table is committed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

# (repository, package directory) for each proto package the roots reach.
PACKAGES = {
    "k8s.io.api.{}".format(d.replace("/", ".")): ("api", d)
    for d in (
        "core/v1",
        "apps/v1",
        "batch/v1",
        "policy/v1",
        "coordination/v1",
        "events/v1",
        "rbac/v1",
        "networking/v1",
        "admissionregistration/v1",
        "resource/v1",
        "resource/v1beta1",
        "resource/v1beta2",
        "authentication/v1",
        "authorization/v1",
        "autoscaling/v1",
        "scheduling/v1alpha3",
    )
} | {
    "k8s.io.apimachinery.pkg.apis.meta.v1": ("apimachinery", "pkg/apis/meta/v1"),
    "k8s.io.apimachinery.pkg.runtime": ("apimachinery", "pkg/runtime"),
    "k8s.io.apimachinery.pkg.runtime.schema": ("apimachinery", "pkg/runtime/schema"),
    "k8s.io.apimachinery.pkg.api.resource": ("apimachinery", "pkg/api/resource"),
    "k8s.io.apimachinery.pkg.util.intstr": ("apimachinery", "pkg/util/intstr"),
}

# Messages the codec converts itself (their JSON is a string, a number or raw JSON): not expanded.
SPECIAL = {
    "apis.meta.v1.Time",
    "apis.meta.v1.MicroTime",
    "apis.meta.v1.Duration",
    "api.resource.Quantity",
    "util.intstr.IntOrString",
    "runtime.RawExtension",
    "apis.meta.v1.FieldsV1",
}

# The kinds served in protobuf: (apiVersion, kind) -> message; each kind's List too.
_CORE = [
    "Pod",
    "Node",
    "Namespace",
    "Event",
    "ConfigMap",
    "Secret",
    "ServiceAccount",
    "Service",
    "Endpoints",
    "Binding",
]
ROOTS: list[tuple[str, str, str]] = (
    [("v1", k, f"core.v1.{k}") for k in _CORE]
    + [("apps/v1", k, f"apps.v1.{k}") for k in ("Deployment", "ReplicaSet", "DaemonSet", "StatefulSet")]
    + [
        ("batch/v1", "Job", "batch.v1.Job"),
        ("policy/v1", "PodDisruptionBudget", "policy.v1.PodDisruptionBudget"),
        ("policy/v1", "Eviction", "policy.v1.Eviction"),
        ("coordination.k8s.io/v1", "Lease", "coordination.v1.Lease"),
        ("events.k8s.io/v1", "Event", "events.v1.Event"),
        ("autoscaling/v1", "Scale", "autoscaling.v1.Scale"),
    ]
    + [
        ("rbac.authorization.k8s.io/v1", k, f"rbac.v1.{k}")
        for k in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
    ]
    + [("networking.k8s.io/v1", k, f"networking.v1.{k}") for k in ("NetworkPolicy", "Ingress", "IngressClass")]
    + [
        ("admissionregistration.k8s.io/v1", k, f"admissionregistration.v1.{k}")
        for k in (
            "ValidatingWebhookConfiguration",
            "MutatingWebhookConfiguration",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        )
    ]
    + [
        (f"resource.k8s.io/{v}", k, f"resource.{v}.{k}")
        for v in ("v1", "v1beta1", "v1beta2")
        for k in ("ResourceSlice", "ResourceClaim", "ResourceClaimTemplate", "DeviceClass")
    ]
    + [
        ("authorization.k8s.io/v1", k, f"authorization.v1.{k}")
        for k in ("SelfSubjectAccessReview", "SelfSubjectRulesReview", "SubjectAccessReview")
    ]
    + [("authentication.k8s.io/v1", k, f"authentication.v1.{k}") for k in ("TokenRequest", "TokenReview")]
)
UNLISTED = {
    "Binding",
    "Eviction",
    "Scale",
    "SelfSubjectAccessReview",
    "SelfSubjectRulesReview",
    "SubjectAccessReview",
    "TokenRequest",
    "TokenReview",
}
META = [
    "apis.meta.v1.Status",
    "apis.meta.v1.WatchEvent",
    "apis.meta.v1.DeleteOptions",
    "apis.meta.v1.PartialObjectMetadata",
    "apis.meta.v1.PartialObjectMetadataList",
    "runtime.Unknown",
]

SCALARS = {"string", "bytes", "bool", "int32", "int64", "uint32", "uint64", "double", "float"}
_FIELD = re.compile(r"^\s*(optional|repeated)\s+([.\w]+)\s+(\w+)\s*=\s*(\d+)\s*;")
_MAP = re.compile(r"^\s*map<\s*(\w+)\s*,\s*([.\w]+)\s*>\s+(\w+)\s*=\s*(\d+)\s*;")
_STRUCT = re.compile(r"^type (\w+) struct \{")
_GOFIELD = re.compile(
    r'^\s*(?:(\w+)\s+)?(\*?)(\[\]|map\[[^\]]+\])?[\w.*\[\]]*\s+`json:"([^",]*)((?:,\w+)*)"'
    r'.*?protobuf:"\w+,(\d+),'
)


def short(package: str) -> str:
    for prefix in ("k8s.io.api.", "k8s.io.apimachinery.pkg."):
        if package.startswith(prefix):
            return package[len(prefix) :]
    raise ValueError(f"unexpected proto package {package}")


def git_show(repo: Path, path: str) -> str:
    return subprocess.run(
        ["git", "--git-dir", str(_gitdir(repo)), "show", f"HEAD:{path}"], check=True, capture_output=True, text=True
    ).stdout


def git_ls(repo: Path, directory: str) -> list[str]:
    out = subprocess.run(
        ["git", "--git-dir", str(_gitdir(repo)), "ls-tree", "--name-only", "HEAD", directory + "/"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return out.split()


def _gitdir(repo: Path) -> Path:
    return repo / ".git" if (repo / ".git").exists() else repo


def parse_proto(text: str, package: str) -> tuple[dict[str, list[tuple[str, str, int, Any]]], set[str]]:
    """message -> [(name, label, number, type or (key, value) for maps)]; and the nullable (list) messages."""
    messages: dict[str, list[Any]] = {}
    nullable: set[str] = set()
    current: str | None = None
    pending_nullable = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("//"):
            if "+protobuf.nullable=true" in stripped and current is None:
                pending_nullable = True
            continue
        if stripped.startswith("message "):
            current = f"{package}.{stripped.split()[1]}"
            messages[current] = []
            if pending_nullable:
                nullable.add(current)
            pending_nullable = False
            continue
        if stripped == "}":
            current = None
            continue
        if current is None:
            continue
        if m := _MAP.match(line):
            messages[current].append((m.group(3), "map", int(m.group(4)), (m.group(1), _resolve(m.group(2), package))))
        elif m := _FIELD.match(line):
            messages[current].append((m.group(3), m.group(1), int(m.group(4)), _resolve(m.group(2), package)))
    return messages, nullable


def _resolve(type_name: str, package: str) -> str:
    if type_name in SCALARS:
        return type_name
    if type_name.startswith("."):
        return type_name[1:]
    return f"{package}.{type_name}"


def parse_go(text: str) -> dict[tuple[str, int], tuple[str, bool, bool]]:
    """(struct, field number) -> (JSON name, inline, keep zero) from the Go struct tags."""
    out: dict[tuple[str, int], tuple[str, bool, bool]] = {}
    struct = None
    for line in text.splitlines():
        if m := _STRUCT.match(line):
            struct = m.group(1)
            continue
        if line.startswith("}"):
            struct = None
            continue
        if struct is None or line.lstrip().startswith("//"):
            continue
        m = _GOFIELD.match(line)
        if not m:
            continue
        _, pointer, _, json_name, opts, number = m.groups()
        inline = json_name == ""  # an embedded struct without a JSON name: its fields are inlined
        keep_zero = bool(pointer) or "omitempty" not in opts
        out[(struct, int(number))] = (json_name, inline, keep_zero)
    return out


def main(api_repo: Path, machinery_repo: Path, out: Path) -> None:
    repos = {"api": api_repo, "apimachinery": machinery_repo}
    messages: dict[str, list[Any]] = {}
    nullable: set[str] = set()
    go: dict[str, dict[tuple[str, int], tuple[str, bool, bool]]] = {}
    for package, (repo, directory) in PACKAGES.items():
        msgs, nulls = parse_proto(git_show(repos[repo], f"{directory}/generated.proto"), package)
        messages |= {short(k): v for k, v in msgs.items()}
        nullable |= {short(k) for k in nulls}
        tags: dict[tuple[str, int], tuple[str, bool, bool]] = {}
        for path in git_ls(repos[repo], directory):
            base = path.rsplit("/", 1)[-1]
            if base.endswith(".go") and not base.endswith("_test.go") and "generated" not in base:
                tags |= parse_go(git_show(repos[repo], path))
        go[short(package)] = tags

    roots = [msg for _, _, msg in ROOTS] + [f"{msg}List" for _, kind, msg in ROOTS if kind not in UNLISTED] + META
    seen: dict[str, Any] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name in SPECIAL:
            continue
        if name not in messages:
            raise SystemExit(f"message {name} is not in the parsed .proto files")
        package, _, struct = name.rpartition(".")
        fields = {}
        for field, label, number, type_ in messages[name]:
            json_name, inline, keep_zero = go.get(package, {}).get((struct, number), (field, False, False))
            if not json_name and not inline:
                json_name = field
            if label == "map":
                kind: Any = ("map", type_[0], _short_type(type_[1]))
                if type_[1] not in SCALARS:
                    todo.append(_short_type(type_[1]))
            else:
                t = _short_type(type_)
                kind = ("inline" if inline else "*" if label == "repeated" else "1", t)
                if type_ not in SCALARS:
                    todo.append(t)
            fields[number] = (json_name, *kind, keep_zero) if kind[0] != "map" else (json_name, *kind, False)
        seen[name] = fields

    kinds = {(api_version, kind): msg for api_version, kind, msg in ROOTS}
    kinds |= {(api_version, f"{kind}List"): f"{msg}List" for api_version, kind, msg in ROOTS if kind not in UNLISTED}
    kinds |= {
        ("v1", "Status"): "apis.meta.v1.Status",
        ("meta.k8s.io/v1", "Status"): "apis.meta.v1.Status",
        ("v1", "DeleteOptions"): "apis.meta.v1.DeleteOptions",
        ("meta.k8s.io/v1", "DeleteOptions"): "apis.meta.v1.DeleteOptions",
        ("meta.k8s.io/v1", "PartialObjectMetadata"): "apis.meta.v1.PartialObjectMetadata",
        ("meta.k8s.io/v1", "PartialObjectMetadataList"): "apis.meta.v1.PartialObjectMetadataList",
    }
    write(out, seen, kinds, sorted(n for n in nullable if n in seen), api_repo, machinery_repo)


def _short_type(type_: str) -> str:
    return type_ if type_ in SCALARS else short(type_.rpartition(".")[0]) + "." + type_.rpartition(".")[2]


def _head(repo: Path) -> str:
    return subprocess.run(
        ["git", "--git-dir", str(_gitdir(repo)), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()


def write(
    out: Path,
    messages: dict[str, Any],
    kinds: dict[tuple[str, str], str],
    nullable: list[str],
    api_repo: Path,
    machinery_repo: Path,
) -> None:
    lines = [
        '"""GENERATED by embedded/apiserver/protoschema/generate.py: do not edit.',
        "",
        f"From k8s.io/api {_head(api_repo)} and k8s.io/apimachinery {_head(machinery_repo)}.",
        "MESSAGES: message -> {field number: (JSON name, label, type, keep zero)}; label is '1' (optional),",
        "'*' (repeated), 'inline' (an embedded struct whose fields JSON inlines) or 'map' (then type is the key",
        "type and a fifth item the value type). KINDS: (apiVersion, kind) -> message. NULLABLE: messages whose",
        'JSON is the list of their `items`."""',
        "",
        "from typing import Any",
        "",
        "MESSAGES: dict[str, dict[int, tuple[Any, ...]]] = {",
    ]
    for name in sorted(messages):
        lines.append(f"    {name!r}: {{")
        for number in sorted(messages[name]):
            lines.append(f"        {number}: {messages[name][number]!r},")
        lines.append("    },")
    lines.append("}")
    lines.append("")
    lines.append("KINDS: dict[tuple[str, str], str] = {")
    lines += [f"    {k!r}: {v!r}," for k, v in sorted(kinds.items())]
    lines.append("}")
    lines.append("")
    lines.append(f"NULLABLE: frozenset[str] = frozenset({nullable!r})")
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(__file__).with_name("table.py"))
