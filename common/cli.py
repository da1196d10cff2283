"""Command-line conventions shared by both services: one-line errors, logging."""

from __future__ import annotations

import argparse
import logging
import sys


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports bad flags as one line naming the problem, not a usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def fail(prog: str, message: str) -> "NoReturn":  # noqa: F821
    sys.stderr.write(f"{prog}: error: {message}\n")
    raise SystemExit(2)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
