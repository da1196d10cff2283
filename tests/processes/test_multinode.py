"""One engine over two nodes (vLLM's `mp` executor, PP=2): the engine service is
node 0 and `engine_service.worker_node` is node 1, both on this host. Node 1
declares an identity of its own, so its worker never pushes to the engine
service's socket and its rows take the collective_rpc path, as on another
machine. Capture matches transformers, and a probe abort through a real router
lands at its token."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.activations import from_batch
from tests.capture.engines import CaptureRun, Request
from tests.capture.oracle import RELATIVE_TOLERANCE, TransformersOracle, compare_with_oracle
from tests.capture.workloads import every_tensor_type, prompt
from tests.e2e import stack
from tests.processes.aborts import ABORT_LATENCY_BOUND, arm
from engine_service.worker_node import NODE0_GONE_EXIT_CODE
from tools import processes
from undercurrent.v1 import undercurrent_pb2 as pb
from undercurrent.v1 import undercurrent_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.vllm, pytest.mark.multiworker]

NUM_LAYERS = 4
PARITY_TOKENS = 5


@pytest.fixture(scope="module")
async def two_nodes(tiny_llama_path, tmp_path_factory):
    node_flags = ["--pipeline-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
                  "--master-port", str(stack.free_port())]
    router = stack.router(stack.free_port(), tmp_path_factory.mktemp("probes")).start()
    # One worker per node, each bound to a core of its own.
    engine = stack.engine(tiny_llama_path, router.address, *node_flags, "--node-rank", "0",
                          workers_bind="0").start()
    worker = processes.worker_node(tiny_llama_path, 1, node_flags, workers_bind="1").start()
    try:
        await router.wait_health(want_serving=None, timeout=60)
        await engine.wait_health(want_serving=True, timeout=300)
        assert worker.process.poll() is None, worker.log_tail()
        async with stack.channel(engine.address) as channel:
            yield engine, worker, router, pb_grpc.EngineServiceStub(channel)
    finally:
        engine.kill()
        worker.kill()
        router.kill()


async def test_node_1_holds_the_second_stage_and_is_drained_by_rpc(two_nodes):
    engine_service, worker, _, engine = two_nodes
    info = (await engine.GetModelInfo(pb.GetModelInfoRequest())).model
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

    def message(req: Request) -> pb.GenerateRequest:
        points = [p.to_proto() for p in req.points]
        for point in points:
            point.stream_to_client = True
        return pb.GenerateRequest(
            request_id=req.request_id, token_ids=pb.TokenIds(ids=req.prompt_token_ids),
            sampling=pb.SamplingParams(max_tokens=req.max_tokens, temperature=0, ignore_eos=True),
            extraction_points=points)

    outcomes = await asyncio.gather(*[stack.generate(engine, message(r)) for r in requests])
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
    aborted, other = await armed.probed_pair("probed")
    after_trigger = armed.check_abort(aborted)
    print(f"two nodes: abort latency {after_trigger} tokens after the triggering token, "
          f"{time.monotonic() - started:.2f} s for the pair")
    assert 0 <= after_trigger <= ABORT_LATENCY_BOUND
    assert other.reason == "LENGTH" and other.tokens == armed.baseline[1].tokens


# Node 1 notices in NODE0_MISSES checks NODE0_CHECK_INTERVAL_S apart (15 s);
# without the watch it waits for node 0 forever.
NODE1_EXIT_BOUND_S = 60


async def test_node_1_exits_when_node_0_goes_away(two_nodes):
    """Runs last: it ends the engine. A supervisor then restarts node 1, which
    joins the engine's next start instead of waiting on the old one."""
    engine_service, worker, _, _ = two_nodes
    engine_service.kill()
    started = time.monotonic()
    while worker.process.poll() is None and time.monotonic() - started < NODE1_EXIT_BOUND_S:
        await asyncio.sleep(0.5)
    print(f"node 1 exited {time.monotonic() - started:.1f} s after node 0 was killed")
    assert worker.process.returncode == NODE0_GONE_EXIT_CODE, worker.log_tail()
    assert "node 0 (127.0.0.1:" in worker.log_tail(80)
