"""Engines serving bfloat16 and float16 (real vLLM in engine service processes,
compiled as served by default): the activations Generate streams to the client,
decoded by the Python client and by the Node.js client, against transformers in
the same dtype teacher-forced on the same tokens, for every tensor type on every
layer at TP=1, TP=2 and PP=2. The tolerance is the dtype's
(`oracle.relative_tolerance`), and each wrong capture of `wrong_captures` fails
it on every row it changes. Greedy tokens match the reference's wherever its top
two logits are not within rounding of each other."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass

import numpy as np
import pytest
from google.protobuf.json_format import MessageToDict

from tests.capture.oracle import (
    RECORDS_PER_POSITION,
    UNIT_ROUNDOFF,
    TransformersOracle,
    compare_with_oracle,
    references,
    row_errors,
)
from tests.capture.workloads import every_tensor_type, prompt
from tests.capture.wrong_captures import WRONG_CAPTURES
from tests.e2e import node_live
from tools import stack
from tools.capture_engines import Request
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client import Activations, AsyncEngineClient, Generation

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
# Two prompts, one request at a time: a request alone in the engine computes the
# same rows when the Node client sends it again.
REQUESTS = [
    Request(f"half-{length}", prompt(length, seed), every_tensor_type(), max_tokens=MAX_TOKENS)
    for length, seed in ((5, 21), (16, 22))
]
POINT_TYPES = {p.name: p.tensor_type for p in every_tensor_type()}
# (tensor parallel, pipeline parallel) -> CPU thread binding of the workers.
TOPOLOGIES = {(1, 1): None, (2, 1): "0|1", (1, 2): "0|1"}
CELLS = [
    pytest.param((dtype, tp, pp), id=f"{dtype}-tp{tp}-pp{pp}",
                 marks=[pytest.mark.multiworker] if tp * pp > 1 else [])
    for dtype in ("bfloat16", "float16")
    for tp, pp in TOPOLOGIES
]


@dataclass
class Served:
    """One engine's runs of REQUESTS, as the Python client decoded them."""

    dtype: str
    tp: int
    pp: int
    address: str
    info: types_pb.ModelInfo
    generations: dict[str, Generation]
    batches: dict[str, list[types_pb.ActivationBatch]]

    @property
    def name(self) -> str:
        return f"{self.dtype} TP={self.tp} PP={self.pp}"

    @property
    def tokens(self) -> dict[str, list[int]]:
        return {rid: g.token_ids for rid, g in self.generations.items()}

    def records(self) -> dict[tuple, np.ndarray]:
        """(request, point, layer, position) -> float32 row, as the client decoded it."""
        return {key: row for g in self.generations.values() for key, row in g.activations.arrays.items()}


@functools.cache
def oracle(model_path: str, dtype: str) -> TransformersOracle:
    return TransformersOracle(model_path, dtype)


@pytest.fixture(scope="module", params=CELLS)
async def served(request, tiny_llama_path):
    dtype, tp, pp = request.param
    flags = ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
    started = time.monotonic()
    engine = stack.engine(tiny_llama_path, "", *flags, dtype=dtype,
                          workers_bind=TOPOLOGIES[(tp, pp)]).start()
    try:
        await engine.wait_health(want_serving=True, timeout=600)
        print(f"\n{dtype} TP={tp} PP={pp}: engine serving after {time.monotonic() - started:.0f} s")
        async with AsyncEngineClient(stack.engine_connection(engine.address), timeout=300) as client:
            info = await client.model_info()
            streams = {r.request_id: [e async for e in client.generate(r.generate_request())]
                       for r in REQUESTS}
        yield Served(
            dtype, tp, pp, engine.address, info,
            generations={rid: Generation.of(events) for rid, events in streams.items()},
            batches={rid: [e.batch for e in events if isinstance(e, Activations)]
                     for rid, events in streams.items()},
        )
    finally:
        engine.kill()


@pytest.fixture(scope="module")
async def reference(served, tiny_llama_path):
    """(oracle in the served dtype, record id -> (request, Reference))."""
    same_precision = await asyncio.to_thread(oracle, tiny_llama_path, served.dtype)
    return same_precision, await asyncio.to_thread(references, same_precision, served, REQUESTS)


def in_roundoffs(value: float, dtype: str) -> str:
    return f"{value:.2e} ({value / UNIT_ROUNDOFF[dtype]:.1f}u)"


async def test_every_row_is_served_in_the_dtype_and_matches_the_reference(served, reference):
    """Every position of both requests, every tensor type on every layer, in the
    engine's dtype on the wire, within the dtype's tolerance of the reference."""
    assert served.info.dtype == served.dtype
    info = served.info
    assert (info.tensor_parallel_size, info.pipeline_parallel_size) == (served.tp, served.pp)
    records = served.records()
    for req in REQUESTS:
        generation = served.generations[req.request_id]
        assert generation.reason == "LENGTH" and len(generation.token_ids) == MAX_TOKENS
        assert set(generation.activations.wire_dtypes.values()) == {served.dtype}
        positions = len(req.prompt_token_ids) + MAX_TOKENS - 1
        captured = [k for k in records if k[0] == req.request_id]
        assert len(captured) == positions * RECORDS_PER_POSITION
        assert {k[3] for k in captured} == set(range(positions))
    same_precision, _ = reference
    worst = await asyncio.to_thread(compare_with_oracle, same_precision, served, REQUESTS)
    assert set(worst) == {"residual_stream", "attn_out", "mlp_out", "final_norm"}
    print(f"\n{served.name}: worst relative L2 error per row against transformers in {served.dtype} "
          f"(tolerance {in_roundoffs(same_precision.tolerance, served.dtype)}): "
          + ", ".join(f"{t} {in_roundoffs(e, served.dtype)}" for t, e in worst.items()))


async def test_greedy_tokens_match_the_reference_outside_ties(served, reference, record_property):
    """Wherever no other token is within rounding of the reference's top one
    (`TransformersOracle.greedy_steps`), vLLM chose that token; ties are counted."""
    same_precision, refs = reference
    records = served.records()
    steps = []
    for req in REQUESTS:
        final_norm = {k[3]: row for k, row in records.items()
                      if k[0] == req.request_id and POINT_TYPES[k[1]] == "final_norm"}
        steps += same_precision.greedy_steps(refs[req.request_id][1], final_norm,
                                             len(req.prompt_token_ids), served.tokens[req.request_id])
    ties = [s for s in steps if s.tie]
    record_property("greedy_steps", len(steps))
    record_property("greedy_ties", len(ties))
    print(f"\n{served.name}: {len(ties)} of {len(steps)} greedy steps are ties "
          f"(positions {[s.position for s in ties]}; vLLM took the reference's top token at "
          f"{sum(s.token == s.reference_token for s in ties)} of them)")
    assert [s for s in steps if not s.tie and s.token != s.reference_token] == []
    assert len(ties) < len(steps)


@pytest.mark.parametrize("wrong", WRONG_CAPTURES, ids=str)
async def test_the_tolerance_rejects_a_wrong_capture_on_every_row(served, reference, wrong):
    """The rows the engine served, compared with what a broken capture would have
    delivered instead: the comparison fails, and it would on every row alone, so
    a capture wrong at one point, layer and request only fails it too."""
    same_precision, refs = reference
    with pytest.raises(AssertionError, match="relative L2 error"):
        compare_with_oracle(same_precision, served, REQUESTS, expected=wrong.row)
    records = served.records()
    errors = row_errors(records, refs, wrong.row)
    assert {tensor_type for tensor_type, _ in errors.values()} == wrong.tensor_types
    # Every (request, point, layer) of the types it changes has rows it is checked on.
    assert {k[:3] for k in errors} == {k[:3] for k in records if POINT_TYPES[k[1]] in wrong.tensor_types}
    nearest = min(error for _, error in errors.values())
    print(f"\n{served.name}, {wrong}: nearest row {in_roundoffs(nearest, served.dtype)}, "
          f"tolerance {in_roundoffs(same_precision.tolerance, served.dtype)}")
    assert nearest > same_precision.tolerance


async def test_the_node_client_decodes_the_rows_as_served(served, tmp_path):
    """The Node client sends the first request again and must decode, bit for bit,
    the rows the Python client decoded (and the reference accepted), in the dtype
    they were served in."""
    first = REQUESTS[0]
    request = MessageToDict(first.generate_request())
    del request["requestId"]
    rows = [row for batch in served.batches[first.request_id] for row in node_live.row_dicts(batch)]
    assert {row["dtype"] for row in rows} == {served.dtype}
    summary, output = await node_live.run({"capture": {"request": request, "rows": rows}}, tmp_path,
                                          served.address, name_pattern="live activations decode")
    assert (summary["pass"], summary["fail"]) == ("1", "0"), output
