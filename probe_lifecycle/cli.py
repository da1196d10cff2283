"""Command-line conventions of the lifecycle commands: bad flags and bad input end
with exit status 2 and one line naming the problem, never a usage dump or traceback."""

from __future__ import annotations

import argparse

from common.cli import fail

__all__ = ["OneLineParser", "fail"]


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
