"""One table of token-selector cases, run through both services' real code paths.

The engine decides which rows it captures (`RowMapper.plan`, over the requests that share a point); the
router decides which delivered rows a probe reads (a live Session scoring a
batch). Both call `common.capture_spec.TokenSelector.mask`; this table pins the
semantics and proves that neither side has a rule of its own.
"""

import json

import numpy as np
import pytest

from common.activations import Block
from common.capture_spec import ExtractionPoint, Scope, TokenSelector
from engine_service.capture.worker.row_mapping import Registration, RowMapper
from common.probe_format.files import write_probe
from common.probe_format.manifest import parse_manifest
from tests.router.helpers import HIDDEN, SessionClient, manifest, start_router
from undercurrent.v1 import types_pb2 as types_pb

# Every request runs positions 0..TOTAL-1; prompt lengths differ per request so a
# rule that mixed up one request's prompt length with another's would show.
TOTAL = 9
PROMPT_TOKENS = {"short": 2, "mid": 5, "long": 8}

# (selector, {request: selected positions}); indexes and ranges count within the scope.
CASES = [
    (TokenSelector(Scope.ALL), {r: list(range(TOTAL)) for r in PROMPT_TOKENS}),
    (TokenSelector(Scope.PROMPT), {"short": [0, 1], "mid": [0, 1, 2, 3, 4], "long": list(range(8))}),
    (TokenSelector(Scope.GENERATED), {"short": list(range(2, 9)), "mid": [5, 6, 7, 8], "long": [8]}),
    # Negative prompt indexes count from each request's own prompt end.
    (TokenSelector(Scope.PROMPT, indexes=(-1,)), {"short": [1], "mid": [4], "long": [7]}),
    (TokenSelector(Scope.PROMPT, indexes=(0, -2)), {"short": [0], "mid": [0, 3], "long": [0, 6]}),
    (TokenSelector(Scope.PROMPT, ranges=((-3, None),)), {"short": [0, 1], "mid": [2, 3, 4], "long": [5, 6, 7]}),
    (TokenSelector(Scope.PROMPT, ranges=((1, -1),)), {"short": [], "mid": [1, 2, 3], "long": [1, 2, 3, 4, 5, 6]}),
    # Generated index g is position prompt_tokens + g; an open range runs to the end.
    (TokenSelector(Scope.GENERATED, indexes=(0, 2)), {"short": [2, 4], "mid": [5, 7], "long": [8]}),
    (TokenSelector(Scope.GENERATED, ranges=((1, None),)), {"short": list(range(3, 9)), "mid": [6, 7, 8], "long": []}),
    (TokenSelector(Scope.GENERATED, ranges=((1, 3),)), {"short": [3, 4], "mid": [6, 7], "long": []}),
    # ALL counts absolute positions, whatever the prompt length.
    (TokenSelector(Scope.ALL, indexes=(0,), ranges=((6, 8),)), {r: [0, 6, 7] for r in PROMPT_TOKENS}),
    (TokenSelector(Scope.ALL, ranges=((7, None),)), {r: [7, 8] for r in PROMPT_TOKENS}),
]
IDS = [f"case{i}" for i in range(len(CASES))]


def engine_selection(selector: TokenSelector) -> dict[str, list[int]]:
    """What the engine's row mapping captures when every position passes through the model."""
    mapper = RowMapper(range(0, 2), num_layers=2, has_final_norm=False)
    point = ExtractionPoint("p", "residual_stream", (1,), selector)
    for request_id, prompt_tokens in PROMPT_TOKENS.items():
        mapper.register(Registration(request_id, (point,), prompt_tokens))
    # One step with each request's whole sequence as one chunk (vLLM id suffixes included).
    req_ids = [f"{r}-0123abcd" for r in PROMPT_TOKENS]
    query_start_loc = np.arange(len(req_ids) + 1) * TOTAL
    positions = np.tile(np.arange(TOTAL), len(req_ids))
    got = {r: [] for r in PROMPT_TOKENS}
    for rows in mapper.plan(req_ids, query_start_loc, positions).get(("residual_stream", 1), []):
        for request_id, position, generated in zip(rows.request_ids, rows.positions.tolist(),
                                                   rows.is_generated.tolist()):
            got[request_id].append(position)
            assert generated == (position >= PROMPT_TOKENS[request_id])
    return got


async def router_selection(tmp_path, selector: TokenSelector) -> dict[str, list[int]]:
    """What a live router's probe scores when it is sent every position of every request."""
    tokens = {"scope": selector.scope.value, "indexes": list(selector.indexes),
              "ranges": [{"start": s} if e is None else {"start": s, "stop": e} for s, e in selector.ranges]}
    write_probe(tmp_path / "reader", manifest("reader", kind="linear", threshold=1e9, action="observe",
                                              tokens=tokens),
                {"weight": np.eye(HIDDEN)[0], "bias": np.array([0.0])})
    router = await start_router(tmp_path)
    client = SessionClient(router)
    try:
        await client.open()
        rows, ids, positions = [], [], []
        for request_id, prompt_tokens in PROMPT_TOKENS.items():
            client.start(request_id, "reader", prompt_tokens=prompt_tokens)
            for position in range(TOTAL):
                rows.append(np.full(HIDDEN, float(position), np.float32))
                ids.append(request_id)
                positions.append(position)
        positions = np.array(positions, dtype=np.int64)
        client.batch(Block("p", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, 1, np.stack(rows), ids, positions,
                           positions >= np.array([PROMPT_TOKENS[r] for r in ids])))
        got = {r: [] for r in PROMPT_TOKENS}
        for message in await client.sync():
            if message.WhichOneof("message") == "scores":
                scores = message.scores.probe_scores
                got[scores.request_id] += list(scores.token_positions)
                # The probe reads row[0], which is the position: the scored row is the named one.
                assert list(scores.scores) == [float(p) for p in scores.token_positions]
        return got
    finally:
        await client.close()
        await router.shutdown(grace_period=0)


@pytest.mark.parametrize(("selector", "expected"), CASES, ids=IDS)
def test_engine_captures_what_the_table_says(selector, expected):
    selector.validate("case")
    assert engine_selection(selector) == expected


@pytest.mark.parametrize(("selector", "expected"), CASES, ids=IDS)
async def test_router_scores_what_the_table_says(tmp_path, selector, expected):
    assert await router_selection(tmp_path, selector) == expected


def test_scalar_and_per_row_prompt_lengths_agree():
    """The engine passes one prompt length, the router one per row: same answer."""
    positions = np.arange(TOTAL)
    for selector, _ in CASES:
        for prompt_tokens in PROMPT_TOKENS.values():
            np.testing.assert_array_equal(
                selector.mask(positions, prompt_tokens),
                selector.mask(positions, np.full(TOTAL, prompt_tokens)),
            )


@pytest.mark.parametrize("selector", [selector for selector, _ in CASES], ids=IDS)
def test_a_selector_written_as_json_reads_back_as_a_probe_manifest_reads_it(selector):
    data = selector.to_dict()
    assert parse_manifest(json.dumps(manifest("p", tokens=data))).tokens == selector
    assert set(data) <= {"scope", "indexes", "ranges"} and json.loads(json.dumps(data)) == data
