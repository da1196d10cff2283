"""Where a benchmark's JSON result goes, and the provenance every result carries:
the command that produced it, when, and on what machine. Figures on shared
cores mean little without the load they were taken under, so the machine line
ends with the load average at the time of writing."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def provenance(started: float | None = None) -> dict:
    """The command (this process's own), its start date and the machine."""
    module = Path(sys.argv[0]).stem
    return {
        "command": " ".join(["python -m", f"bench.{module}", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs, "
                   f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
                   f"load average {os.getloadavg()[0]:.1f} at the end",
        "python": platform.python_version(),
    }


def write(name: str | Path, report: dict) -> Path:
    """Writes `report` under bench/results/ (or to an absolute path) and says where."""
    path = Path(name) if Path(name).is_absolute() else RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr, flush=True)
    return path


def medians(rounds: list[dict]) -> dict:
    """The median over rounds of every number a round reports, keyed as a round is
    (nested dicts alike); lists and flags stay in the rounds alone."""
    return {key: medians([r[key] for r in rounds]) if isinstance(value, dict)
            else statistics.median(r[key] for r in rounds)
            for key, value in rounds[0].items()
            if isinstance(value, (dict, int, float)) and not isinstance(value, bool)}


def write_rounds(name: str | Path, started: float, args, unit: str, rounds: list[dict], **extra) -> dict:
    """Writes a benchmark's rounds with their medians, its arguments and its provenance; returns that report."""
    report = {**provenance(started), "args": vars(args), "unit": unit, **extra,
              "rounds": rounds, "medians": medians(rounds)}
    write(name, report)
    return report
