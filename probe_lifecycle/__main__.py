"""`python -m probe_lifecycle {capture,import,train,deploy,demo} ...`: one entry for the steps."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "capture": "probe_lifecycle.capture",
    "import": "probe_lifecycle.importing",
    "train": "probe_lifecycle.train",
    "deploy": "probe_lifecycle.deploy",
    "demo": "probe_lifecycle.demo",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        sys.stderr.write(f"usage: python -m probe_lifecycle {{{','.join(COMMANDS)}}} ... "
                         "(each takes --help)\n")
        return 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
