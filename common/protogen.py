"""Generates the Python stubs of the contract in proto/ with grpcio-tools.

The stubs are checked in (KServe's practice) so that a clone imports without a
build step; tests/test_proto_stubs.py regenerates them into a temporary folder
and fails when the checked-in copy is stale. Run: `make proto`.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
DEFAULT_OUT = REPO_ROOT / "common"
PACKAGE_INIT = '"""Generated from proto/undercurrent; regenerate with `make proto`."""\n'


def proto_files() -> list[str]:
    """The contract's files. proto/google holds vendored googleapis files, which
    protoc reads as imports only: their Python modules come from
    googleapis-common-protos."""
    return sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "undercurrent").rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py under out_dir; returns them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *proto_files(),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see its message above")
    written = []
    for package_dir in {(out_dir / f).parent for f in proto_files()}:
        for folder in [package_dir, *package_dir.parents]:
            if folder == out_dir:
                break
            init = folder / "__init__.py"
            init.write_text(PACKAGE_INIT)
        written.extend(sorted(package_dir.glob("*_pb2*.py*")))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path.relative_to(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
