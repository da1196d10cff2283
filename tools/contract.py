"""The contract's checks with buf: it lints clean, and it breaks nothing the
released contract promised.

proto/released/undercurrent-v1.binpb is a buf image of undercurrent.v1 as
released. `buf breaking` compares proto/ with it under buf.yaml's FILE rules:
a field, message, enum value or service removed, renumbered, retyped or renamed
(its JSON name too) fails the check, while additions pass. `make check-contract`
runs `python -m tools.contract check`; `make test` runs the same checks
(tests/foundation/test_proto_lint.py). Releasing a new contract version writes
its image with `python -m tools.contract release`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from tools import node_client

REPO = Path(__file__).resolve().parent.parent
RELEASED = REPO / "proto" / "released" / "undercurrent-v1.binpb"


def buf(*args: str, root: Path = REPO) -> subprocess.CompletedProcess:
    """Runs the pinned buf (clients/node) in the workspace `root` (its buf.yaml)."""
    return subprocess.run([str(node_client.buf()), *args], cwd=root, capture_output=True, text=True,
                          timeout=120)


def lint(root: Path = REPO) -> subprocess.CompletedProcess:
    return buf("lint", root=root)


def breaking(root: Path = REPO, against: Path = RELEASED) -> subprocess.CompletedProcess:
    return buf("breaking", "--against", str(against), root=root)


def release(out: Path = RELEASED, root: Path = REPO) -> subprocess.CompletedProcess:
    """Writes the image of the contract in `root` (without comments: the
    checks compare names, numbers and types only)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return buf("build", "--exclude-source-info", "-o", str(out), root=root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.contract", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("check", "release"),
                        help="check: buf lint and buf breaking against the released image; "
                             "release: write the image of proto/ as the released contract")
    args = parser.parse_args(argv)
    steps = [lint, breaking] if args.command == "check" else [release]
    for step in steps:
        result = step()
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        if result.returncode != 0:
            print(f"contract {step.__name__}: failed", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
