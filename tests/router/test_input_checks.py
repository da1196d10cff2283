"""Hostile and broken input on a real router over loopback: every error names the
request, its incarnation and the batch step; one bad block or row never costs the
others their scores; limits answer RESOURCE_EXHAUSTED; bytes that are not a
message answer INVALID_ARGUMENT; an unexpected exception answers INTERNAL."""

import asyncio

import grpc
import numpy as np
import pytest
from google.rpc import code_pb2

from common.activations import to_batch
from router_service import session as session_module
from router_service.servicers import AdminServicer
from tests.router.helpers import HIDDEN, SessionClient, block, channel, errors, kinds, linear_probe
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc

E0 = np.eye(HIDDEN)[0]


@pytest.fixture
def probes_dir(tmp_path):
    # "watch": observe, score = row[0], every token (scope all) so positions are reported as sent.
    linear_probe(tmp_path, "watch", E0, kind="linear", threshold=0.0, action="observe",
                 tokens={"scope": "all"})
    return tmp_path


def start(client: SessionClient, rid: str, incarnation: int, *bindings: session_pb.SessionBinding) -> None:
    """request_start of these bindings, or of "watch" at the version the router listed."""
    bindings = list(bindings) or [session_pb.SessionBinding(probe="watch", digest=client.digests["watch"])]
    client.send(request_start=session_pb.RequestStart(request_id=rid, incarnation=incarnation, bindings=bindings))


def scored(replies) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for m in replies:
        if m.WhichOneof("message") == "scores":
            scores = m.scores.probe_scores
            out.setdefault(scores.request_id, []).extend(zip(scores.token_positions, scores.scores))
    return out


def rows(*values) -> np.ndarray:
    out = np.zeros((len(values), HIDDEN))
    out[:, 0] = values
    return out


async def test_an_overflowing_shape_is_refused_alone_and_the_rest_of_the_batch_is_scored(
        make_router, probes_dir):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    start(client, "a", 11)
    start(client, "b", 12)
    batch = to_batch([block(rows(1.0), ["a"], [0], layer=1), block(rows(2.0), ["b"], [0], layer=1)])
    # 2**32 * 2**32 rows of empty data: the element count wraps to 0 in int64 arithmetic.
    del batch.blocks[0].rows.shape[:]
    batch.blocks[0].rows.shape.extend([2**32, 2**32])
    batch.blocks[0].rows.data = b""
    step = client.raw_batch(batch)
    replies = await client.until_ack(step)
    [err] = errors(replies)
    assert (err.request_id, err.incarnation, err.step, err.code) == ("a", 11, step, code_pb2.INVALID_ARGUMENT)
    assert "blocks[0] (p@1).rows: tensor.data has 0 bytes but shape [4294967296, 4294967296]" in err.message
    assert scored(replies) == {"b": [(0, 2.0)]}
    assert [m.scores.incarnation for m in replies if m.scores.probe_scores.request_id] == [12]
    await client.close()


async def test_a_block_that_fails_unexpectedly_is_internal_for_its_requests_only(
        make_router, probes_dir, monkeypatch):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    start(client, "a", 1)
    start(client, "b", 2)
    real = session_module.BatchReader.block

    def fails_on_block_0(reader, i):
        if i == 0:
            raise MemoryError("injected")
        return real(reader, i)

    monkeypatch.setattr(session_module.BatchReader, "block", fails_on_block_0)
    step = client.batch(block(rows(1.0), ["a"], [0], layer=1), block(rows(2.0), ["b"], [0], layer=1))
    replies = await client.until_ack(step)
    assert [(e.request_id, e.incarnation, e.step, e.code) for e in errors(replies)] == [
        ("a", 1, step, code_pb2.INTERNAL)]
    assert errors(replies)[0].message == "blocks[0]: internal error: MemoryError: injected; the block was not scored"
    assert scored(replies) == {"b": [(0, 2.0)]}
    await client.close()


async def test_nonfinite_and_negative_position_rows_are_refused_per_request_and_the_rest_scored(
        make_router, probes_dir):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    start(client, "a", 5)
    start(client, "b", 6)
    values = rows(1.0, np.nan, 3.0, 4.0, np.inf)
    step = client.batch(block(values, ["a", "a", "a", "b", "b"], [0, 1, -2, 0, 1]))
    replies = await client.until_ack(step)
    got = sorted((e.request_id, e.incarnation, e.step, e.code, e.message) for e in errors(replies))
    assert got == [
        ("a", 5, step, code_pb2.INVALID_ARGUMENT,
         "blocks[0] (p@1).rows: 1 row(s) with NaN or Inf at token_positions [1]; those rows were not scored"),
        ("a", 5, step, code_pb2.INVALID_ARGUMENT,
         "blocks[0] (p@1).rows: 1 row(s) with a negative token position at token_positions [-2]; "
         "those rows were not scored"),
        ("b", 6, step, code_pb2.INVALID_ARGUMENT,
         "blocks[0] (p@1).rows: 1 row(s) with NaN or Inf at token_positions [1]; those rows were not scored"),
    ]
    assert scored(replies) == {"a": [(0, 1.0)], "b": [(0, 4.0)]}
    await client.close()


async def test_an_unknown_tensor_type_or_unattributable_block_names_every_request_it_may_hold(
        make_router, probes_dir):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    start(client, "a", 1)
    start(client, "b", 2)
    batch = to_batch([block(rows(1.0), ["a"], [0]), block(rows(2.0), ["b"], [0])])
    batch.blocks[0].tensor_type = 9
    step = client.raw_batch(batch)
    replies = await client.until_ack(step)
    assert [(e.request_id, e.step, e.message) for e in errors(replies)] == [
        ("a", step, "blocks[0].tensor_type: 9 is not a TensorType; the block was not scored")]
    assert scored(replies) == {"b": [(0, 2.0)]}

    batch = to_batch([block(rows(1.0), ["a"], [1]), block(rows(2.0), ["b"], [1])])
    batch.blocks[1].request_index[0] = 7  # points at no request id
    step = client.raw_batch(batch)
    replies = await client.until_ack(step)
    # The block cannot be matched to a request: every request of the batch hears of it.
    assert sorted((e.request_id, e.incarnation, e.step) for e in errors(replies)) == [("a", 1, step), ("b", 2, step)]
    assert "request_index: index out of range of 2 request ids" in errors(replies)[0].message
    assert scored(replies) == {"a": [(1, 1.0)]}
    await client.close()


async def test_records_of_unknown_and_ended_requests_name_the_step_and_the_last_incarnation(
        make_router, probes_dir):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    start(client, "done", 3)
    client.send(request_end=session_pb.RequestEnd(request_id="done", incarnation=3))
    # An end for an incarnation that is not running is refused, not applied.
    start(client, "live", 4)
    client.send(request_end=session_pb.RequestEnd(request_id="live", incarnation=99))
    step = client.batch(block(rows(1.0, 2.0, 3.0), ["done", "never", "live"], [0, 0, 0]))
    replies = await client.until_ack(step)
    got = sorted((e.request_id, e.incarnation, e.step, code_pb2.Code.Name(e.code)) for e in errors(replies))
    assert got == [("done", 3, step, "FAILED_PRECONDITION"),
                   ("live", 99, 0, "NOT_FOUND"),
                   ("never", 0, step, "NOT_FOUND")]
    assert scored(replies) == {"live": [(0, 3.0)]}
    assert router.live_requests() == 1
    await client.close()


async def test_unknown_enum_values_in_request_start_are_refused_naming_the_field(make_router, probes_dir):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    start(client, "r", 8, session_pb.SessionBinding(probe="watch", failure_policy=9, digest=client.digests["watch"]),
          session_pb.SessionBinding(probe="watch", action=5, digest=client.digests["watch"]))
    replies = await client.sync()
    assert [(e.request_id, e.incarnation, e.code, e.message) for e in errors(replies)] == [
        ("r", 8, code_pb2.INVALID_ARGUMENT, "request_start.bindings[0].failure_policy: 9 is not a FailurePolicy"),
        ("r", 8, code_pb2.INVALID_ARGUMENT, "request_start.bindings[1].action: 5 is not a ProbeAction"),
    ]
    await client.close()


async def test_a_request_start_without_an_id_or_with_a_negative_prompt_is_refused_naming_the_field(
        make_router, probes_dir):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    watch = session_pb.SessionBinding(probe="watch", digest=client.digests["watch"])
    client.send(request_start=session_pb.RequestStart(request_id="", incarnation=4, bindings=[watch]))
    client.send(request_start=session_pb.RequestStart(request_id="r", incarnation=5, prompt_tokens=-1,
                                                      bindings=[watch]))
    replies = await client.sync()
    assert [(e.request_id, e.incarnation, e.code, e.message) for e in errors(replies)] == [
        ("", 4, code_pb2.INVALID_ARGUMENT, "request_start.request_id is empty"),
        ("r", 5, code_pb2.INVALID_ARGUMENT, "request_start.prompt_tokens -1 is negative"),
    ]
    assert router.live_requests() == 0
    await client.close()


async def test_requests_past_the_per_session_limit_get_resource_exhausted(make_router, probes_dir):
    router = await make_router(probes_dir, max_requests_per_session=2)
    client = SessionClient(router)
    await client.open()
    for i in range(3):
        start(client, f"r{i}", 100 + i)
    replies = await client.sync()
    assert [(e.request_id, e.incarnation, e.code) for e in errors(replies)] == [
        ("r2", 102, code_pb2.RESOURCE_EXHAUSTED)]
    assert "--max-requests-per-session" in errors(replies)[0].message
    assert router.live_requests() == 2
    client.send(request_end=session_pb.RequestEnd(request_id="r0", incarnation=100))
    start(client, "r2", 103)
    assert errors(await client.sync()) == []
    assert router.live_requests() == 2
    await client.close()


async def test_sessions_past_the_limit_get_resource_exhausted(make_router, probes_dir):
    router = await make_router(probes_dir, max_sessions=1)
    first = SessionClient(router)
    await first.open()
    second = SessionClient(router, engine_id="engine-2")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await second.open()
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-sessions" in refused.value.details()
    await second.close()
    await first.close()
    # The freed slot serves the next engine.
    third = SessionClient(router, engine_id="engine-3")
    for _ in range(250):
        if not router.sessions:
            break
        await asyncio.sleep(0.02)
    assert not router.sessions
    await third.open()
    await third.close()


@pytest.mark.parametrize("payload", [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x12\x80\x80\x80\x80\x10"])
async def test_bytes_that_are_no_message_are_invalid_argument_on_unary_and_streaming_calls(
        make_router, probes_dir, payload):
    router = await make_router(probes_dir)
    async with channel(router) as ch:
        load = ch.unary_unary("/undercurrent.v1.ProbeAdminService/LoadProbe")
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await load(payload, timeout=10)
        assert unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid undercurrent.v1.LoadProbeRequest message" in unary.value.details()

        # A valid hello, then garbage: the session ends INVALID_ARGUMENT.
        session = ch.stream_stream("/undercurrent.v1.ProbeRouterService/Session")
        hello = session_pb.SessionRequest(hello=session_pb.SessionHello(engine_id="e", model=types_pb.ModelInfo(
            hidden_size=HIDDEN, num_layers=4))).SerializeToString()
        call = session(iter([hello, payload]), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as streaming:
            async for _ in call:
                pass
        assert streaming.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid undercurrent.v1.SessionRequest message" in streaming.value.details()
    # State returned to zero and the router still serves.
    assert router.live_requests() == 0
    client = SessionClient(router)
    await client.open()
    await client.close()


async def test_an_unexpected_exception_in_a_servicer_is_internal_and_logged(make_router, probes_dir,
                                                                             monkeypatch, caplog):
    async def broken(self, request, context):
        raise ZeroDivisionError("injected")

    monkeypatch.setattr(AdminServicer, "ListProbes", broken)  # before the server binds its handlers
    router = await make_router(probes_dir)
    stub = admin_pb_grpc.ProbeAdminServiceStub(channel(router))
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await stub.ListProbes(admin_pb.ListProbesRequest(), timeout=10)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert failed.value.details() == "internal error: ZeroDivisionError: injected"
    [record] = [r for r in caplog.records if r.message == "unexpected error in handler"]
    assert record.exc_info[0] is ZeroDivisionError


async def test_an_unknown_enum_in_hello_refuses_the_session_naming_the_field(make_router, probes_dir):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.open(types_pb.ModelInfo(model="m", hidden_size=HIDDEN, num_layers=4, tensor_types=[1, 12]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "hello.model.tensor_types[1]: 12 is not a TensorType"
    await client.close()
    assert router.live_requests() == 0 and not router.sessions


async def test_an_internal_failure_on_request_start_names_the_request_and_incarnation(
        make_router, probes_dir, monkeypatch):
    router = await make_router(probes_dir)
    client = SessionClient(router)
    await client.open()
    [session] = router.sessions

    def broken(msg):
        raise KeyError("injected")

    monkeypatch.setattr(session.state, "start", broken)
    start(client, "r", 42)
    replies = await client.sync()
    assert [(e.request_id, e.incarnation, e.code, e.message) for e in errors(replies)] == [
        ("r", 42, code_pb2.INTERNAL, "request_start: internal error: KeyError: 'injected'")]
    await client.close()
