"""One engine over two nodes (vLLM's `mp` executor, PP=2): the engine service is
node 0 and `engine_service.worker_node` is node 1, both on this host. Node 1
declares an identity of its own, so its worker never pushes to the engine
service's socket and its rows take the collective_rpc path, as on another
machine. Capture matches transformers, and a probe abort through a real router
lands at its token."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.activations import from_batch
from tests.capture.oracle import RELATIVE_TOLERANCE, TransformersOracle, compare_with_oracle
from tests.capture.workloads import every_tensor_type, prompt
from tools import processes, stack
from tools.aborts import ABORT_LATENCY_BOUND, ROUTER_TIMEOUT_S, arm
from tools.capture_engines import CaptureRun, Request
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

pytestmark = [pytest.mark.vllm, pytest.mark.multiworker]

NUM_LAYERS = 4
PARITY_TOKENS = 5
NODE_TIMEOUT_S = 5  # the engine's --node-timeout


@pytest.fixture(scope="module")
async def two_nodes(tiny_llama_path, tmp_path_factory):
    node_flags = ["--pipeline-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
                  "--master-port", str(stack.free_port())]
    router = stack.router(stack.free_port(), tmp_path_factory.mktemp("probes")).start()
    # One worker per node, each bound to a core of its own.
    engine = stack.engine(tiny_llama_path, router.address, *node_flags, "--node-rank", "0",
                          "--node-timeout", str(NODE_TIMEOUT_S), router_timeout_s=ROUTER_TIMEOUT_S,
                          workers_bind="0").start()
    worker = processes.worker_node(tiny_llama_path, 1, node_flags, workers_bind="1").start()
    try:
        await router.wait_health(want_serving=None, timeout=60)
        await engine.wait_health(want_serving=True, timeout=300)
        assert worker.process.poll() is None, worker.log_tail()
        async with stack.channel(engine.address) as channel:
            yield engine, worker, router, engine_pb_grpc.EngineServiceStub(channel)
    finally:
        engine.kill()
        worker.kill()
        router.kill()


async def test_node_1_holds_the_second_stage_and_is_drained_by_rpc(two_nodes):
    engine_service, worker, _, engine = two_nodes
    info = (await engine.GetModelInfo(engine_pb.GetModelInfoRequest())).model
    assert (info.tensor_parallel_size, info.pipeline_parallel_size) == (1, 2)
    assert [(r.rank, r.pp_rank, r.start_layer, r.end_layer, r.has_final_norm) for r in info.ranks] == [
        (0, 0, 0, 2, False), (1, 1, 2, 4, True)]
    log = engine_service.log_path.read_text(errors="replace")
    assert "capture: ranks [1] run on another node and are drained by collective_rpc" in log
    assert "node 1 of 2, joining 127.0.0.1:" in worker.log_path.read_text(errors="replace")


async def test_capture_across_nodes_matches_transformers(two_nodes, tiny_llama_path):
    engine = two_nodes[3]
    requests = [Request(f"nodes-{i}", prompt(length, seed=i), every_tensor_type(), max_tokens=PARITY_TOKENS)
                for i, length in enumerate((5, 11))]

    outcomes = await asyncio.gather(*[stack.generate(engine, r.generate_request()) for r in requests])
    run = CaptureRun(tokens={r.request_id: o.tokens for r, o in zip(requests, outcomes)},
                     blocks=[b for o in outcomes for batch in o.batches for b in from_batch(batch)])
    records = run.records()  # asserts every key arrived once
    for req, outcome in zip(requests, outcomes):
        assert outcome.reason == "LENGTH" and len(outcome.tokens) == PARITY_TOKENS
        fed = len(req.prompt_token_ids) + PARITY_TOKENS - 1
        for point in req.points:
            layers = point.capture_layers(NUM_LAYERS)
            got = {(layer, pos) for rid, name, layer, pos in records if rid == req.request_id and name == point.name}
            # Layers 2-3 and the final norm come only from node 1's worker.
            assert got == {(layer, pos) for layer in layers for pos in range(fed)}, point.name
    oracle = await asyncio.to_thread(TransformersOracle, tiny_llama_path)
    worst = await asyncio.to_thread(compare_with_oracle, oracle, run, requests)
    print(f"two nodes, PP=2: worst relative error per tensor type {worst}")
    assert set(worst) == {"residual_stream", "attn_out", "mlp_out", "final_norm"}
    assert max(worst.values()) < RELATIVE_TOLERANCE


async def test_probe_abort_across_nodes(two_nodes):
    _, _, router, engine = two_nodes
    armed = await arm("nodes", engine, router.address)
    started = time.monotonic()
    latencies = await armed.abort_latencies("probed")
    print(f"two nodes: abort latency {latencies} tokens after the triggering token, "
          f"{time.monotonic() - started:.2f} s for the pairs")
    assert min(latencies) <= ABORT_LATENCY_BOUND, latencies


# The engine checks its workers every NODE_CHECK_INTERVAL_S (5 s) and gives
# each NODE_TIMEOUT_S to answer, then ends requests within ENGINE_LOSS_EXIT_S
# (10 s); without the check it waits for node 1 forever.
ENGINE_EXIT_BOUND_S = 60


async def test_the_engine_exits_when_node_1_goes_away(two_nodes):
    """Runs last: it ends the stack. The engine reports NOT_SERVING and exits 1,
    so a supervisor restarts it and node 1 rejoins its next start."""
    engine_service, worker, _, engine = two_nodes
    worker.kill()
    started = time.monotonic()
    # A request sent at the loss ends with the reason (it does not hang with the engine):
    # ended ERROR if it was running when the engine noticed, refused if it came after.
    try:
        outcome = await stack.generate(engine, engine_pb.GenerateRequest(
            text="anyone there", sampling=engine_pb.SamplingParams(max_tokens=4, temperature=0)),
            timeout=ENGINE_EXIT_BOUND_S)
        assert outcome.reason == "ERROR", outcome.finished
        assert outcome.finished.message.startswith("engine error: a node may be lost: "), outcome.finished
    except grpc.aio.AioRpcError as refused:
        assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
        assert "the engine cannot serve: a node may be lost: " in refused.details()
    while engine_service.process.poll() is None and time.monotonic() - started < ENGINE_EXIT_BOUND_S:
        await asyncio.sleep(0.5)
    print(f"engine exited {time.monotonic() - started:.1f} s after node 1 was killed")
    assert engine_service.process.returncode == 1, engine_service.log_tail()
    log = engine_service.log_tail(200)
    assert "engine_service: NOT_SERVING (a node may be lost: " in log
    assert "exiting: a node may be lost: " in log
