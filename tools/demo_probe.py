"""The probe `make run` binds: a norm monitor on the last layer's residual stream.

It only observes, so the demo prints scores without stopping generation.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.probe_format.files import write_probe

DEMO_PROBE = "residual_norm"


def write_demo_probe(probes_dir: Path, model_dir: Path) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    write_probe(
        probes_dir / DEMO_PROBE,
        {
            "name": DEMO_PROBE,
            "version": "1",
            "kind": "norm",
            "tensor_type": "residual_stream",
            "layers": [config["num_hidden_layers"] - 1],
            "hidden_size": config["hidden_size"],
            "dtype": "float32",
            "threshold": 1e9,
            "action": "observe",
            "tokens": {"scope": "generated"},
        },
    )
    return DEMO_PROBE
