"""Regenerate the committed *_pb2.py / *_pb2_grpc.py beside this file from our .proto sources.

Run from anywhere: `python services/preparer/protos/generate.py` (needs grpcio-tools and mypy-protobuf, dev
extras). Typed stubs (`*_pb2.pyi`, `*_pb2_grpc.pyi`, by mypy-protobuf's protoc plugins) are written beside
them, so `make typecheck` checks every use of the messages and stubs strictly.
The include root is the repository root, so generated modules import each other as
`services.preparer.protos.<name>_pb2` and descriptor file names are unique per version.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PROTOS = (
    "dra_v1.proto",
    "dra_v1beta1.proto",
    "pluginregistration_v1.proto",
    "dra_health_v1alpha1.proto",
    "grpc_health_v1.proto",
)


def main() -> int:
    try:
        from grpc_tools import protoc
    except ImportError:
        print("generate.py: grpcio-tools is missing; install the dev extra (pip install -e '.[dev]')", file=sys.stderr)
        return 2
    rel = HERE.relative_to(REPO)
    # mypy-protobuf's plugins (protoc-gen-mypy, protoc-gen-mypy_grpc) live beside this interpreter
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    args = [
        "protoc",
        f"-I{REPO}",
        f"--python_out={REPO}",
        f"--grpc_python_out={REPO}",
        f"--mypy_out={REPO}",
        f"--mypy_grpc_out={REPO}",
    ]
    args += [str(rel / name) for name in PROTOS]
    code = protoc.main(args)
    if code != 0:
        print(f"generate.py: protoc failed with {code}", file=sys.stderr)
    return int(code)


if __name__ == "__main__":
    raise SystemExit(main())
