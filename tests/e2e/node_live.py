"""The Node.js client's live tests (clients/node/test/live.test.js) against services
a Python test started: the rows it compares with, and how it runs."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

from common.activations import from_batch
from tools import node_client
from tools.dev_security import DevSecurity
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client import batch_arrays


def row_dicts(batch: types_pb.ActivationBatch) -> list[dict]:
    """Rows as the Python client decodes them, float32 values written exactly as JSON,
    with the dtype each travelled in."""
    blocks = from_batch(batch)
    generated = {(b.point, b.layer, int(p)): bool(g) for b in blocks
                 for p, g in zip(b.token_positions, b.is_generated)}
    dtypes = {(b.point, b.layer): b.wire_dtype for b in blocks}
    return [
        {"requestId": k.request_id, "point": k.point, "layer": k.layer, "tokenPosition": k.token_position,
         "isGenerated": generated[(k.point, k.layer, k.token_position)],
         "dtype": dtypes[(k.point, k.layer)],
         "values": [float(v) for v in row]}
        for k, row in batch_arrays(batch).items()
    ]


async def run(fixture: dict, folder: Path, engine: str, router: str | None = None,
              name_pattern: str | None = None, timeout: float = 300) -> tuple[dict[str, str], str]:
    """Runs the Node client's tests (only those whose names match `name_pattern`,
    when given; the others count as skipped) with `fixture` as live.test.js's
    fixture file; returns the summary counts ({"pass": "10", ...}) and the output."""
    fixture_path = folder / "node-fixture.json"
    fixture_path.write_text(json.dumps(fixture))
    await asyncio.to_thread(node_client.install)
    env = dict(os.environ, **DevSecurity.ensure().client_env(), UNDERCURRENT_ENGINE=engine,
               UNDERCURRENT_NODE_FIXTURE=str(fixture_path))
    if router:
        env["UNDERCURRENT_ROUTER"] = router
    pattern = ["--test-name-pattern", name_pattern] if name_pattern else []
    process = await asyncio.create_subprocess_exec(
        "node", "--test", *pattern, "test/", cwd=node_client.NODE_CLIENT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    output = (await asyncio.wait_for(process.communicate(), timeout))[0].decode()
    summary = dict(line[2:].split(" ", 1) for line in output.splitlines()
                   if line.startswith("# ") and line[2:].split(" ")[0] in ("pass", "fail", "skipped"))
    return summary, output
