"""pyproject's pins admit only runtimes the generated gRPC/protobuf code accepts: the generated modules
check their runtime at import (protobuf's ValidateProtobufRuntimeVersion, grpc's GRPC_GENERATED_VERSION),
so a lower bound below what they were generated with installs and then fails at start."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTOS = REPO / "services" / "preparer" / "protos"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _lower_bound(package: str) -> tuple[int, ...]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(rf"{package}\b", d)]
    match = re.search(r">=\s*([0-9.]+)", spec)
    assert match, f"{spec!r} has no lower bound"
    return _version(match.group(1))


def test_protobuf_and_grpcio_lower_bounds_match_the_generated_code() -> None:
    protobuf = {
        _version(m)
        for f in PROTOS.glob("*_pb2.py")
        for m in re.findall(r"# Protobuf Python Version: ([0-9.]+)", f.read_text())
    }
    grpc = {
        _version(m)
        for f in PROTOS.glob("*_pb2_grpc.py")
        for m in re.findall(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", f.read_text())
    }
    assert protobuf and grpc, "no generated modules found"
    assert _lower_bound("protobuf") >= max(protobuf), f"protobuf pin below the generated code's {max(protobuf)}"
    assert _lower_bound("grpcio") >= max(grpc), f"grpcio pin below the generated code's {max(grpc)}"
