"""The Node.js client's tests against services a Python test started: the gRPC
client's live tests (clients/node/test/live.test.js), with the rows they compare
with, and the OpenAI API through the `openai` npm package
(clients/node/test/openai.test.js). Each file has its own variables; a file run
without them skips, so each driver runs only its own files."""

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


# The gRPC client's test files, run by `run`.
GRPC_CLIENT_TESTS = ("test/tensor.test.js", "test/live.test.js")
# The OpenAI API's test file, run by `run_openai`.
OPENAI_TESTS = ("test/openai.test.js",)


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
    """Runs the gRPC client's tests (only those whose names match `name_pattern`,
    when given; the others count as skipped) with `fixture` as live.test.js's
    fixture file; returns the summary counts ({"pass": "10", ...}) and the output."""
    fixture_path = folder / "node-fixture.json"
    fixture_path.write_text(json.dumps(fixture))
    env = dict(DevSecurity.ensure().client_env(), UNDERCURRENT_ENGINE=engine,
               UNDERCURRENT_NODE_FIXTURE=str(fixture_path))
    if router:
        env["UNDERCURRENT_ROUTER"] = router
    pattern = ["--test-name-pattern", name_pattern] if name_pattern else []
    return await node_test([*pattern, *GRPC_CLIENT_TESTS], env, timeout)


async def run_openai(fixture: dict, folder: Path, base_url: str,
                     timeout: float = 300) -> tuple[dict[str, str], str]:
    """Runs openai.test.js against the OpenAI API at `base_url` (https, the
    development CA) as the development callers `demo` and `other`; `fixture`
    names the model, the guard set for `other` and the guard's minTokens.
    Returns the summary counts and the output."""
    fixture_path = folder / "openai-fixture.json"
    fixture_path.write_text(json.dumps(fixture))
    dev = DevSecurity.ensure()
    env = dict(UNDERCURRENT_OPENAI_URL=base_url, UNDERCURRENT_OPENAI_FIXTURE=str(fixture_path),
               NODE_EXTRA_CA_CERTS=str(dev.ca), UNDERCURRENT_TOKEN=dev.client_token,
               UNDERCURRENT_OTHER_TOKEN=dev.other_client_token)
    return await node_test(list(OPENAI_TESTS), env, timeout)


async def node_test(args: list[str], env: dict[str, str], timeout: float) -> tuple[dict[str, str], str]:
    """`node --test args` in clients/node (its packages installed first) with
    `env` on top of this process's; returns node's summary counts and output."""
    await asyncio.to_thread(node_client.install)
    process = await asyncio.create_subprocess_exec(
        "node", "--test", *args, cwd=node_client.NODE_CLIENT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **env})
    output = (await asyncio.wait_for(process.communicate(), timeout))[0].decode()
    summary = dict(line[2:].split(" ", 1) for line in output.splitlines()
                   if line.startswith("# ") and line[2:].split(" ")[0] in ("pass", "fail", "skipped"))
    return summary, output
