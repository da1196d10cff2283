"""ProbeRouter.Session on a real router over loopback, driven by real grpc.aio clients."""

import asyncio
import threading

import grpc
import numpy as np
import pytest
from google.rpc import code_pb2

from common.activations import to_batch
from common.probe_format.files import write_probe
from router_service import session as session_state
from common.probe_format.probes import ProjectionPlan
from router_service.servicers import INLINE_SCORING_BYTES, LiveSession, row_bytes
from tests.router.helpers import (
    HIDDEN, SessionClient, block, bound, errors, kinds, linear_probe, manifest, model_info,
)
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

E0 = np.eye(HIDDEN)[0]  # weight that reads a row's first element
THRESHOLD = 5.0


@pytest.fixture
def probes_dir(tmp_path):
    # "tox": raw score = row[0]; aborts after 2 consecutive rows >= 5.
    linear_probe(tmp_path, "tox", E0, kind="linear", threshold=THRESHOLD, rule={"patience": 2})
    # "watch": observe, raw score = row[1] (generated tokens only, the default scope).
    linear_probe(tmp_path, "watch", np.eye(HIDDEN)[1], kind="linear", threshold=0.0, action="observe")
    # "deep": observe, reads layers 1 and 2, EMA over (token, layer) forward order of row[2].
    write_probe(tmp_path / "deep", manifest("deep", "trajectory", layers=[1, 2], threshold=0.0,
                                            action="observe", base={"kind": "linear"},
                                            aggregation={"kind": "ema", "alpha": 0.5}),
                {"weight": np.eye(HIDDEN)[2]})
    # "prompt": observe, prompt tokens only, raw score = row[3].
    linear_probe(tmp_path, "prompt", np.eye(HIDDEN)[3], kind="linear", threshold=0.0, action="observe",
                 tokens={"scope": "prompt"})
    return tmp_path


def expected_abort(values, patience=2):
    streak = 0
    for position, value in values:
        streak = streak + 1 if value >= THRESHOLD else 0
        if streak >= patience:
            return position, value
    return None


async def test_many_interleaved_requests_abort_exactly_where_the_rule_fired(make_router, probes_dir):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    hello = await client.open()
    assert [p.name for p in hello.probes] == ["deep", "prompt", "tox", "watch"]
    rng = np.random.default_rng(7)
    request_ids = [f"req-{i}" for i in range(24)]
    prompt_tokens = 4
    for rid in request_ids:
        client.start(rid, "tox", "watch", prompt_tokens=prompt_tokens)
    next_position = {rid: prompt_tokens for rid in request_ids}
    sent: dict[str, list[tuple[int, float]]] = {rid: [] for rid in request_ids}
    watch_sent: dict[str, list[tuple[int, float]]] = {rid: [] for rid in request_ids}
    aborts: dict[str, types_pb.Verdict] = {}
    abort_step: dict[str, int] = {}
    watch_got: dict[str, list[tuple[int, float]]] = {rid: [] for rid in request_ids}
    for _ in range(12):
        # Each step carries a random subset of requests, one to three tokens each, rows shuffled.
        present = rng.choice(request_ids, size=10, replace=False)
        rows, ids, positions = [], [], []
        for rid in present:
            for _ in range(int(rng.integers(1, 4))):
                row = rng.normal(size=HIDDEN)
                row[0] = 9.0 if rng.uniform() < 0.3 else 0.0
                rows.append(row), ids.append(rid), positions.append(next_position[rid])
                sent[rid].append((next_position[rid], row[0]))
                watch_sent[rid].append((next_position[rid], np.float32(row[1])))
                next_position[rid] += 1
        order = rng.permutation(len(rows))
        step = client.batch(block(np.array(rows)[order], np.array(ids)[order], np.array(positions)[order]))
        replies = await client.until_ack(step)
        assert kinds(replies)[-1] == "ack" and "ack" not in kinds(replies)[:-1]
        for message in replies:
            if message.WhichOneof("message") == "abort":
                assert message.abort.verdict.request_id not in aborts, "at most one abort per request"
                aborts[message.abort.verdict.request_id] = message.abort.verdict
                abort_step[message.abort.verdict.request_id] = step
            elif message.WhichOneof("message") == "scores":
                scores = message.scores.probe_scores
                assert scores.probe == "watch"
                watch_got[scores.request_id] += zip(scores.token_positions, scores.scores)
        assert errors(replies) == []

    for rid in request_ids:
        fired = expected_abort(sent[rid])
        if fired is None:
            assert rid not in aborts
            continue
        position, value = fired
        verdict = aborts[rid]
        assert (verdict.probe, verdict.token_position, verdict.score) == ("tox", position, value)
        assert "threshold 5" in verdict.reason and "patience 2" in verdict.reason
        # The verdict came before the ack of the step that carried the firing row.
        assert position in [p for p, _ in sent[rid]]
        # Scores of the observe binding: every generated row, in forward order.
        assert watch_got[rid] == sorted(watch_sent[rid])
    assert 3 <= len(aborts) < len(request_ids)
    assert router.live_requests() == 24
    sample = router.metrics.registry.get_sample_value
    rows = sum(len(v) for v in sent.values())
    assert sample("undercurrent_router_batches_total") == 12
    assert sample("undercurrent_router_rows_total") == rows
    assert sample("undercurrent_router_activation_bytes_total") == rows * HIDDEN * 4
    assert sample("undercurrent_router_probe_rows_total", {"probe": "tox"}) == rows
    assert sample("undercurrent_router_aborts_total", {"probe": "tox"}) == len(aborts)
    assert sample("undercurrent_router_probe_seconds_count", {"probe": "watch"}) == 12
    assert sample("undercurrent_router_live_requests") == 24
    await client.close()


async def test_an_engine_that_accepts_replies_gets_each_batchs_replies_as_one_message(make_router, probes_dir):
    """The same steps on two sessions: one engine reads replies one by one, the
    other says accepts_replies and gets, per batch, one SessionReplies holding
    exactly those replies in the same order (scores, the abort, the ack last)."""
    router = await make_router(probes_dir)
    single, bundled = SessionClient(router, "single"), SessionClient(router, "bundled")
    await single.open()
    await bundled.open(accepts_replies=True)
    for client in (single, bundled):
        for rid in ("a", "b", "c"):
            client.start(rid, "tox", "watch", prompt_tokens=4)
    steps = [  # row[0] >= 5 twice in a row aborts ("tox"); row[1] is "watch"'s score
        [("a", 4, 9.0), ("b", 4, 0.0), ("c", 4, 9.0)],
        [("a", 5, 9.0), ("b", 5, 9.0), ("c", 5, 0.0)],
        [("a", 6, 0.0), ("b", 6, 0.0)],
    ]
    aborted = []
    for step_rows in steps:
        rows = np.zeros((len(step_rows), HIDDEN))
        rows[:, 0] = [v for _, _, v in step_rows]
        rows[:, 1] = np.arange(len(step_rows))
        blk = block(rows, [r for r, _, _ in step_rows], [p for _, p, _ in step_rows])
        step = single.batch(blk)
        assert bundled.batch(blk) == step
        one_by_one = await single.until_ack(step)
        message = await bundled.recv()
        while message.WhichOneof("message") in ("heartbeat", "catalog"):
            message = await bundled.recv()
        assert message.WhichOneof("message") == "replies"
        replies = list(message.replies.messages)
        assert kinds(replies)[-1] == "ack" and replies[-1].ack.step == step
        assert replies == one_by_one
        assert len(replies) == len(step_rows) + 1 + (step == 2)  # scores per request, abort of "a", ack
        aborted += [(m.abort.verdict.request_id, m.abort.verdict.token_position)
                    for m in replies if m.WhichOneof("message") == "abort"]
    assert aborted == [("a", 5)]
    await single.close()
    await bundled.close()


async def test_multi_layer_probe_reads_rows_in_forward_order(make_router, probes_dir):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    client.start("r", "deep", prompt_tokens=2)
    rng = np.random.default_rng(3)
    layer1, layer2 = rng.normal(size=(3, HIDDEN)), rng.normal(size=(3, HIDDEN))
    positions = [2, 3, 4]
    # Blocks as two pipeline stages might send them: the later layer's block first.
    step = client.batch(block(layer2, ["r"] * 3, positions, layer=2),
                        block(layer1, ["r"] * 3, positions, layer=1))
    replies = await client.until_ack(step)
    scores = replies[0].scores.probe_scores
    forward = [v for p in range(3) for v in (layer1[p, 2], layer2[p, 2])]
    ema, expected = None, []
    for value in forward:
        ema = value if ema is None else 0.5 * value + 0.5 * ema
        expected.append(ema)
    assert list(scores.token_positions) == [2, 2, 3, 3, 4, 4]
    np.testing.assert_allclose(scores.scores, expected, rtol=1e-5)
    await client.close()


async def test_token_scope_and_action_override(make_router, probes_dir):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    # tox bound as observe: scores, never an abort.
    client.start("r", "tox", "prompt", prompt_tokens=2, actions={"tox": types_pb.PROBE_ACTION_OBSERVE})
    rows = np.zeros((4, HIDDEN))
    rows[:, 0] = 9.0
    rows[:, 3] = [1, 2, 3, 4]
    step = client.batch(block(rows, ["r"] * 4, [0, 1, 2, 3], generated=[False, False, True, True]))
    replies = await client.until_ack(step)
    scored = [m.scores.probe_scores for m in replies if m.WhichOneof("message") == "scores"]
    by_probe = {s.probe: s for s in scored}
    assert "abort" not in kinds(replies)
    assert list(by_probe["tox"].token_positions) == [2, 3]  # generated scope (default)
    assert list(by_probe["prompt"].token_positions) == [0, 1]
    assert list(by_probe["prompt"].scores) == [1.0, 2.0]
    await client.close()


async def test_two_sessions_keep_separate_state_for_the_same_request_id(make_router, probes_dir):
    router = await make_router(probes_dir)
    a, b = SessionClient(router, "engine-a"), SessionClient(router, "engine-b")
    await asyncio.gather(a.open(), b.open())
    a.start("same-id", "tox")
    b.start("same-id", "tox")
    hot, cold = np.zeros((2, HIDDEN)), np.zeros((2, HIDDEN))
    hot[:, 0] = 7.0
    step_a = a.batch(block(hot, ["same-id"] * 2, [10, 11]))
    step_b = b.batch(block(cold, ["same-id"] * 2, [10, 11]))
    replies_a, replies_b = await asyncio.gather(a.until_ack(step_a), b.until_ack(step_b))
    assert kinds(replies_a) == ["abort", "ack"] and replies_a[0].abort.verdict.token_position == 11
    assert kinds(replies_b) == ["ack"]
    assert router.live_requests() == 2
    await a.close()
    await b.close()


async def test_state_freed_at_request_end_and_on_session_drop(make_router, probes_dir):
    router = await make_router(probes_dir)
    tox = next(p for p in router.registry.probes() if p.name == "tox")
    assert router.live_requests() == 0 and tox.active_requests == 0
    client = SessionClient(router)
    await client.open()
    for i in range(10):
        client.start(f"r{i}", "tox", "watch")
    await client.sync()
    assert router.live_requests() == 10 and tox.active_requests == 10
    assert router.metrics.live_requests._value.get() == 10
    for i in range(4):
        client.end(f"r{i}")
    await client.sync()
    assert router.live_requests() == 6 and tox.active_requests == 6
    await client.close()  # the engine goes away with 6 requests running
    # However long the router takes to see the stream end on a loaded host; state
    # that is never freed still fails here.
    deadline = asyncio.get_running_loop().time() + 30
    while router.sessions and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    assert router.live_requests() == 0 and tox.active_requests == 0
    assert router.metrics.live_requests._value.get() == 0
    assert router.metrics.sessions._value.get() == 0


async def test_state_freed_when_the_engines_cancel_lands_during_the_clean_up(
        make_router, probes_dir, monkeypatch):
    """An engine that goes away half-closes its stream and cancels it, and the two
    can reach the router together: the half-close ends the session, and the cancel
    lands while its clean-up is still waiting. The cancel must not cut the clean-up
    short: state left behind would stay for the router's life."""
    router = await make_router(probes_dir)
    tox = next(p for p in router.registry.probes() if p.name == "tox")
    stopping, release = asyncio.Event(), asyncio.Event()
    stop = LiveSession.stop

    async def held_stop(session):  # holds the clean-up open until the cancel has landed
        stopping.set()
        await release.wait()
        await stop(session)

    monkeypatch.setattr(LiveSession, "stop", held_stop)
    client = SessionClient(router)
    await client.open()
    for i in range(5):
        client.start(f"r{i}", "tox")
    await client.sync()
    assert router.live_requests() == 5
    client.outgoing.put_nowait(None)  # the half-close: the session ends, its clean-up starts
    await asyncio.wait_for(stopping.wait(), 20)
    client.call.cancel()
    await asyncio.sleep(1.0)  # the cancel reaches the router's handler over loopback
    release.set()
    deadline = asyncio.get_running_loop().time() + 20
    while router.sessions and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    assert not router.sessions
    assert router.live_requests() == 0 and tox.active_requests == 0
    assert router.metrics.sessions._value.get() == 0
    await client.channel.close()


async def test_scores_rate_limited_flush_at_request_end(make_router, probes_dir):
    router = await make_router(probes_dir, scores_interval=3600.0)
    client = SessionClient(router)
    await client.open()
    client.start("r", "watch", prompt_tokens=0)
    rows = np.zeros((1, HIDDEN))
    first = await client.until_ack(client.batch(block(rows + 1, ["r"], [0])))
    second = await client.until_ack(client.batch(block(rows + 2, ["r"], [1])))
    third = await client.until_ack(client.batch(block(rows + 3, ["r"], [2])))
    assert kinds(first) == ["scores", "ack"]  # the first is due at once
    assert kinds(second) == kinds(third) == ["ack"]
    client.end("r")
    flushed = await client.until("scores")
    flushed = flushed.scores.probe_scores
    assert list(flushed.token_positions) == [1, 2] and list(flushed.scores) == [2.0, 3.0]
    await client.close()


def test_a_batchs_row_bytes_are_what_its_blocks_shapes_declare():
    rows = np.zeros((3, HIDDEN))
    blocks = [block(rows, ["r"] * 3, [0, 1, 2], dtype=dtype) for dtype in ("float32", "bfloat16", "float16")]
    batch = to_batch(blocks)
    assert row_bytes(batch) == sum(len(b.rows.data) for b in batch.blocks) == 3 * HIDDEN * (4 + 2 + 2)
    # A block whose data is short of its shape is sized by the shape (and its decode rejects it).
    batch.blocks[0].rows.ClearField("data")
    assert row_bytes(batch) == 3 * HIDDEN * (4 + 2 + 2)


def corrupt(batch: types_pb.ActivationBatch, edit) -> types_pb.ActivationBatch:
    edit(batch.blocks[0])
    return batch


async def test_bad_records_get_in_band_errors_and_the_stream_lives_on(make_router, probes_dir):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    client.start("r", "tox", prompt_tokens=0)
    client.start("gone", "tox")
    client.end("gone")
    await client.sync()
    good = np.zeros((2, HIDDEN))

    def good_batch(rid="r"):
        return to_batch([block(good, [rid, rid], [0, 1])])

    def set_dtype(b):
        b.rows.dtype = "int8"

    def cut_bytes(b):
        b.rows.data = b.rows.data[:-3]

    def bad_index(b):
        b.request_index[1] = 5

    def huge_shape(b):  # sized by its shape, so scored off the event loop, where decoding rejects it
        b.rows.shape[0] = 2**40

    cases = [
        (corrupt(good_batch(), set_dtype), "r", code_pb2.INVALID_ARGUMENT,
         "blocks[0] (p@1).rows: tensor.dtype 'int8' is not supported"),
        (corrupt(good_batch(), cut_bytes), "r", code_pb2.INVALID_ARGUMENT,
         "blocks[0] (p@1).rows: tensor.data has 125 bytes but shape [2, 16] of float32 needs 128"),
        (to_batch([block(np.zeros((2, HIDDEN + 1)), ["r", "r"], [0, 1])]), "r", code_pb2.INVALID_ARGUMENT,
         "blocks[0] (p@1).rows.shape: hidden size 17 does not match the model's hidden_size 16"),
        (corrupt(good_batch(), bad_index), "r", code_pb2.INVALID_ARGUMENT,
         "blocks[0] (p@1).request_index: index out of range of 1 request ids"),
        (corrupt(good_batch(), huge_shape), "r", code_pb2.INVALID_ARGUMENT,
         f"blocks[0] (p@1).rows: tensor.data has 128 bytes but shape [{2**40}, 16] of float32 needs"),
        (good_batch("never"), "never", code_pb2.NOT_FOUND,
         "blocks[0] (p@1): request 'never' was never started on this session"),
        (good_batch("gone"), "gone", code_pb2.FAILED_PRECONDITION,
         "blocks[0] (p@1): records for request 'gone' after its request_end"),
    ]
    for batch, rid, code, message in cases:
        replies = await client.until_ack(client.raw_batch(batch))
        assert kinds(replies) == ["error", "ack"], (message, replies)
        err = replies[0].error
        assert (err.request_id, err.code) == (rid, code)
        assert err.message.startswith(message), err.message

    # NaN and Inf rows: reported, skipped; the finite rows of the same block are scored.
    rows = np.zeros((4, HIDDEN))
    rows[1, 5], rows[2, 0] = np.nan, np.inf
    rows[[0, 3], 0] = 6.0
    replies = await client.until_ack(client.batch(block(rows, ["r"] * 4, [0, 1, 2, 3])))
    assert kinds(replies) == ["error", "abort", "ack"]
    assert replies[0].error.message.startswith(
        "blocks[0] (p@1).rows: 2 row(s) with NaN or Inf at token_positions [1, 2]")
    # Patience 2 counts rows scored: rows 0 and 3 are consecutive once 1 and 2 are dropped.
    assert replies[1].abort.verdict.token_position == 3

    # Unknown probe, incompatible probe, duplicate request_start: errors, no crash.
    client.start("r", "tox")
    client.start("s", "nope", "tox")
    replies = await client.sync()
    assert [(e.request_id, e.probe, e.code) for e in errors(replies)] == [
        ("r", "", code_pb2.ALREADY_EXISTS), ("s", "nope", code_pb2.NOT_FOUND)]
    assert "probe 'nope' is not loaded" in errors(replies)[1].message
    assert router.live_requests() == 2
    await client.close()


async def test_one_bad_block_does_not_stop_the_good_blocks_of_its_batch(make_router, probes_dir):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    client.start("r", "tox", prompt_tokens=0)
    hot = np.full((2, HIDDEN), 8.0)
    batch = to_batch([block(hot, ["r"] * 2, [0, 1], dtype="bfloat16"),
                      block(hot, ["r"] * 2, [0, 1], layer=3)])
    batch.blocks[1].rows.dtype = "float8"
    replies = await client.until_ack(client.raw_batch(batch))
    assert kinds(replies) == ["error", "abort", "ack"]
    assert replies[0].error.message.startswith("blocks[1] (p@3).rows: tensor.dtype 'float8'")
    assert replies[1].abort.verdict.token_position == 1
    await client.close()


async def test_nan_rows_in_blocks_read_alike_are_named_by_their_own_block(make_router, probes_dir):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    client.start("r", "watch", prompt_tokens=0)  # an observe probe: its scores name what it read
    client.start("s", "watch", prompt_tokens=0)
    await client.sync()
    clean, dirty = np.zeros((3, HIDDEN)), np.zeros((3, HIDDEN))
    dirty[2, 4] = np.nan  # the third row of the second block: s at position 7
    replies = await client.until_ack(client.batch(
        block(clean, ["r", "r", "s"], [5, 6, 7], point="p"), block(dirty, ["r", "r", "s"], [5, 6, 7], point="q")))
    assert kinds(replies) == ["error", "scores", "scores", "ack"]
    assert replies[0].error.request_id == "s"
    assert replies[0].error.message.startswith(
        "blocks[1] (q@1).rows: 1 row(s) with NaN or Inf at token_positions [7]")
    by_request = {m.scores.probe_scores.request_id: list(m.scores.probe_scores.token_positions) for m in replies[1:3]}
    assert by_request == {"r": [5, 5, 6, 6], "s": [7]}
    await client.close()


async def test_nan_rows_of_a_block_no_probe_reads_are_still_reported(make_router, probes_dir):
    """Rows no bound probe reads (layer 3 here) are still checked, through a plan with
    no probes, and reported; the other block of the step is scored as ever."""
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    client.start("r", "watch", prompt_tokens=0)
    await client.sync()
    dirty = np.zeros((2, HIDDEN))
    dirty[1, 0] = np.inf
    replies = await client.until_ack(client.batch(
        block(np.zeros((2, HIDDEN)), ["r", "r"], [5, 6]), block(dirty, ["r", "r"], [5, 6], layer=3)))
    assert kinds(replies) == ["error", "scores", "ack"]
    assert replies[0].error.request_id == "r"
    assert replies[0].error.message.startswith(
        "blocks[1] (p@3).rows: 1 row(s) with NaN or Inf at token_positions [6]")
    assert list(replies[1].scores.probe_scores.token_positions) == [5, 6]
    await client.close()


async def test_a_fault_in_blocks_read_alike_spares_the_blocks_other_probes_read(make_router, probes_dir,
                                                                               monkeypatch):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    client.start("r", "tox", "deep", prompt_tokens=0)
    await client.sync()
    evaluate = ProjectionPlan.evaluate

    def broken_for_deep_alone(plan, blocks, wire_dtype):  # layer 2 is read by "deep" alone, layer 1 by both
        if [p.name for p in plan.probes] == ["deep"]:
            raise RuntimeError("injected fault")
        return evaluate(plan, blocks, wire_dtype)

    monkeypatch.setattr(ProjectionPlan, "evaluate", broken_for_deep_alone)
    hot = np.full((2, HIDDEN), 8.0)
    step = client.batch(block(hot, ["r"] * 2, [0, 1], layer=1), block(hot, ["r"] * 2, [0, 1], layer=2))
    replies = await client.until_ack(step)
    assert kinds(replies) == ["error", "scores", "abort", "ack"]
    assert (replies[0].error.code, replies[0].error.step) == (code_pb2.INTERNAL, step)
    assert replies[0].error.message == (
        "blocks[1]: internal error: RuntimeError: injected fault; the block was not scored")
    deep = replies[1].scores.probe_scores
    assert (deep.probe, list(deep.token_positions)) == ("deep", [0, 1])
    assert (replies[2].abort.verdict.probe, replies[2].abort.verdict.token_position) == ("tox", 1)
    await client.close()


async def test_incompatible_probes_are_left_out_of_the_catalog_and_reported(make_router, tmp_path):
    linear_probe(tmp_path, "fits", E0)
    linear_probe(tmp_path, "wide", np.ones(32), hidden_size=32)
    linear_probe(tmp_path, "deep", E0, layers=[7])
    linear_probe(tmp_path, "attn", E0, tensor_type="attn_out")
    router = await make_router(tmp_path)
    client = SessionClient(router)
    hello = await client.open(model_info(layers=4))
    assert [p.name for p in hello.probes] == ["fits"]
    reported = [await client.recv() for _ in range(3)]
    assert {(m.error.request_id, m.error.probe, m.error.code) for m in reported} == {
        ("", "attn", code_pb2.FAILED_PRECONDITION), ("", "deep", code_pb2.FAILED_PRECONDITION),
        ("", "wide", code_pb2.FAILED_PRECONDITION)}
    messages = {m.error.probe: m.error.message for m in reported}
    assert messages["wide"] == "probe 'wide': hidden_size 32 does not match the model's hidden_size 16"
    assert "layers [7] are out of range" in messages["deep"]
    assert "tensor_type 'attn_out' is not offered" in messages["attn"]
    client.start("r", "deep")
    replies = await client.sync()
    assert [(e.code, e.probe) for e in errors(replies)] == [(code_pb2.FAILED_PRECONDITION, "deep")]
    await client.close()


async def test_heartbeats_are_echoed_and_sent_on_an_interval(make_router, probes_dir):
    router = await make_router(probes_dir, heartbeat_interval=0.1)
    client = SessionClient(router)
    await client.open()
    client.send(heartbeat=session_pb.Heartbeat(sent_unix_nanos=42))
    beats = [(await client.until("heartbeat")).heartbeat.sent_unix_nanos for _ in range(3)]
    assert 42 in beats and any(b > 10**18 for b in beats)
    await client.close()


async def test_first_message_must_be_hello(make_router, probes_dir):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    client.call = client.stub.Session(client._messages())
    client.start("r", "tox")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.recv()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first SessionRequest must be hello, got 'request_start'" in err.value.details()
    await client.close()


async def test_drain_refuses_new_requests_and_stops_after_active_ones_end(make_router, probes_dir):
    router = await make_router(probes_dir, grace_period=10.0)
    client = SessionClient(router)
    await client.open()
    client.start("running", "tox", prompt_tokens=0)
    await client.sync()
    shutdown = asyncio.create_task(router.shutdown())
    drain = await client.until("drain")
    assert "shutting down" in drain.drain.reason
    client.start("late", "tox")
    replies = await client.sync()
    assert [(e.request_id, e.code) for e in errors(replies)] == [("late", code_pb2.UNAVAILABLE)]
    # The running request is still scored while draining.
    hot = np.full((2, HIDDEN), 6.0)
    replies = await client.until_ack(client.batch(block(hot, ["running"] * 2, [0, 1])))
    assert kinds(replies) == ["abort", "ack"]
    assert not shutdown.done()
    client.end("running")
    await asyncio.wait_for(shutdown, 5.0)
    await client.close()


async def test_trajectory_abort_over_interleaved_requests_matches_a_loop(make_router, tmp_path):
    """Stateful probes keep one EMA per request across batches, rows in any order."""
    write_probe(tmp_path / "ema", manifest("ema", "trajectory", threshold=4.5, rule={"min_tokens": 3},
                                           base={"kind": "linear"}, aggregation={"kind": "ema", "alpha": 0.5}),
                {"weight": np.eye(HIDDEN)[4]})
    router = await make_router(tmp_path)
    client = SessionClient(router)
    await client.open()
    rng = np.random.default_rng(11)
    request_ids = [f"t{i}" for i in range(8)]
    for rid in request_ids:
        client.start(rid, "ema", prompt_tokens=0)
    values = {rid: [] for rid in request_ids}
    aborts = {}
    for step_index in range(6):
        rows, ids, positions = [], [], []
        for rid in request_ids:
            for _ in range(2):
                row = np.zeros(HIDDEN)
                row[4] = rng.choice([0.0, 6.0], p=[0.6, 0.4])
                rows.append(row), ids.append(rid), positions.append(len(values[rid]))
                values[rid].append(row[4])
        order = rng.permutation(len(rows))
        replies = await client.until_ack(client.batch(
            block(np.array(rows)[order], np.array(ids)[order], np.array(positions)[order])))
        aborts |= {m.abort.verdict.request_id: m.abort.verdict for m in replies if m.WhichOneof("message") == "abort"}
    for rid in request_ids:
        ema, expected = None, None
        for position, value in enumerate(values[rid]):
            ema = value if ema is None else 0.5 * value + 0.5 * ema
            if expected is None and ema >= 4.5 and position + 1 >= 3:
                expected = (position, ema)
        if expected is None:
            assert rid not in aborts
        else:
            assert (aborts[rid].token_position, aborts[rid].score) == pytest.approx(expected)
    assert 0 < len(aborts) < len(request_ids)
    await client.close()


async def test_an_internal_failure_still_acks_the_step_and_keeps_the_session(make_router, probes_dir,
                                                                              monkeypatch):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    client.send(request_start=session_pb.RequestStart(request_id="r", bindings=bound(router.registry, "tox"),
                                              incarnation=7))
    client.send(request_start=session_pb.RequestStart(request_id="q", bindings=bound(router.registry, "tox"),
                                              incarnation=8))

    def broken(*args):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(session_state, "first_firing_segments", broken)  # the decision rule, after the gathering
    step = client.batch(block(np.zeros((2, HIDDEN)), ["r", "q"], [0, 0]))
    replies = await client.until_ack(step)
    # One error per request of the batch, each naming its request, incarnation and step.
    assert kinds(replies) == ["error", "error", "ack"]
    assert [(e.request_id, e.incarnation, e.step, e.code) for e in errors(replies)] == [
        ("q", 8, step, code_pb2.INTERNAL), ("r", 7, step, code_pb2.INTERNAL)]
    assert replies[0].error.message == (
        "batch: internal error: RuntimeError: injected fault; the batch was not scored")
    monkeypatch.undo()
    hot = np.full((2, HIDDEN), 6.0)
    replies = await client.until_ack(client.batch(block(hot, ["r"] * 2, [1, 2])))
    assert kinds(replies) == ["abort", "ack"] and replies[0].abort.verdict.token_position == 2
    assert replies[0].abort.incarnation == 7
    await client.close()


async def test_a_verdict_never_waits_for_a_scoring_thread(make_router, probes_dir):
    """A step's rows are scored on the event loop, so a verdict does not wait for
    a scoring thread to be free (or scheduled); a batch too big to score there
    still goes to the scoring threads and is scored the same."""
    router = await make_router(probes_dir, scoring_threads=1)
    client = SessionClient(router)
    await client.open()
    client.start("r", "tox")
    client.start("big", "watch")
    client.start("mid", "watch")
    release = threading.Event()
    router.executor.submit(release.wait)  # the only scoring thread is taken
    try:
        hot = np.full((2, HIDDEN), 6.0)
        replies = await client.until_ack(client.batch(block(hot, ["r"] * 2, [4, 5])))
        assert kinds(replies) == ["abort", "ack"] and replies[0].abort.verdict.token_position == 5
        # A decode step of many requests (1 MiB of rows here) is scored there too.
        mid_rows = (1 << 20) // (4 * HIDDEN)
        mid_values = np.arange(mid_rows, dtype=np.float32)
        mid = block(np.outer(mid_values, np.eye(HIDDEN)[1]), ["mid"] * mid_rows, np.arange(4, 4 + mid_rows))
        assert 256 * 1024 < row_bytes(to_batch([mid])) <= INLINE_SCORING_BYTES
        replies = await client.until_ack(client.batch(mid))
        assert kinds(replies) == ["scores", "ack"]
        assert replies[0].scores.probe_scores.scores == pytest.approx(mid_values)
    finally:
        release.set()
    rows = INLINE_SCORING_BYTES // (4 * HIDDEN) + 1
    values = np.arange(rows, dtype=np.float32)
    big = block(np.outer(values, np.eye(HIDDEN)[1]), ["big"] * rows, np.arange(4, 4 + rows))
    assert row_bytes(to_batch([big])) > INLINE_SCORING_BYTES
    replies = await client.until_ack(client.batch(big))
    assert kinds(replies) == ["scores", "ack"]
    assert list(replies[0].scores.probe_scores.token_positions) == list(range(4, 4 + rows))
    assert replies[0].scores.probe_scores.scores == pytest.approx(values)
    await client.close()
