"""`make run RUN_ARGS=--norm-demo`'s generation (tools/run_demo.demo) on the
package's engine, with a router serving the demo's norm monitor. `make run`
itself, its lifecycle demo and its start-up, runs in tests/processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import run_demo, stack
from tools.demo_probe import write_demo_probe
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

pytestmark = pytest.mark.vllm


async def test_the_norm_demo_streams_text_and_the_monitors_scores(engine_service, start_router, tmp_path,
                                                                  tiny_llama_path, capsys):
    probe = write_demo_probe(tmp_path / "probes", Path(tiny_llama_path))
    await start_router(0, tmp_path / "probes")
    async with stack.channel(engine_service.address) as channel:
        await stack.wait_for_probe(engine_pb_grpc.EngineServiceStub(channel), probe)
    capsys.readouterr()
    await run_demo.demo(engine_service, "The quick brown fox", 12, probe)
    out = capsys.readouterr().out
    assert "model LlamaForCausalLM: 4 layers, hidden 128, float32, TP=1 PP=1" in out
    assert "--- finished: LENGTH, 12 tokens ---" in out
    # A norm monitor of generated tokens scores each one the engine computed: all but the last.
    assert f"probe {probe}: 11 scores" in out
