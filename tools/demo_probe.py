"""The probe `make run` binds: the shipped norm monitor on the last layer's
residual stream, shaped for the model the demo serves.

It only observes, so the demo prints scores without stopping generation.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.probe_format.files import write_probe
from tools.shipped_probe import PROBE_NAME, norm_monitor

DEMO_PROBE = PROBE_NAME


def write_demo_probe(probes_dir: Path, model_dir: Path) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    write_probe(probes_dir / DEMO_PROBE, norm_monitor(config))
    return DEMO_PROBE
