"""Per-caller quotas and cache salts (plain logic; test_attack_callers.py runs
them on an engine process)."""

import pytest

from common.errors import ResourceExhausted
from common.security.auth import ANONYMOUS
from engine_service.request.callers import CallerLimits, Callers
from engine_service.request.client_stream import ClientStream
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb


def activations(rows: int) -> engine_pb.GenerateResponse:
    batch = types_pb.ActivationBatch()
    batch.blocks.add(token_positions=list(range(rows)))
    return engine_pb.GenerateResponse(activations=batch)


def test_a_caller_holds_at_most_its_streams_and_the_count_follows_them():
    callers = Callers(CallerLimits(max_streams=2))
    with callers.stream("alice"), callers.stream("alice"):
        with pytest.raises(ResourceExhausted, match=r"caller 'alice' already runs 2 Generate streams"):
            with callers.stream("alice"):
                pass
        with callers.stream("bob"):  # another caller is not counted against alice
            assert (callers.account("alice").streams, callers.account("bob").streams) == (2, 1)
    assert callers.account("alice") is None and callers.account("bob") is None
    with callers.stream(ANONYMOUS) as share:  # without tokens nobody is told apart
        assert share is None


async def test_a_callers_queued_bytes_count_across_its_streams_and_leave_with_a_cancelled_one():
    event = activations(10)
    size = event.ByteSize()
    callers = Callers(CallerLimits(max_queued_bytes=3 * size))

    def stream() -> ClientStream:
        return ClientStream(budget_bytes=100 * size, max_activation_message_bytes=1 << 20)

    with callers.stream("alice") as first_share:
        first = stream()
        assert first.share is first_share  # the call's share, current while the call runs
        assert [first.put_nowait(event) for _ in range(2)] == [True, True]
        with callers.stream("alice"):
            second = stream()
            assert [second.put_nowait(event) for _ in range(2)] == [True, False]  # 3 events: the caller's cap
            assert second.dropped_records == 10
            # Tokens and finished are the answer: never dropped, and counted.
            assert second.put_nowait(engine_pb.GenerateResponse(tokens=engine_pb.TokenChunk(token_ids=[1])))
            await first.get()
            await first.get()
            assert second.put_nowait(event)  # room again once the client read
            with callers.stream("bob"):
                assert stream().put_nowait(event)  # bob has a budget of his own
        # The second call ended with its events unread: they leave alice's count.
        assert callers.account("alice").queued_bytes == first.queued_bytes == 0
        assert [first.put_nowait(event) for _ in range(4)] == [True, True, True, False]
    assert callers.account("alice") is None


def test_salts_differ_between_callers_and_processes_and_stay_for_one():
    one, other = Callers(), Callers()
    assert one.cache_salt("alice") == one.cache_salt("alice") != one.cache_salt("bob")
    assert one.cache_salt("alice") != other.cache_salt("alice")  # a key drawn per process
    assert one.cache_salt(ANONYMOUS) is None
    assert "alice" not in one.cache_salt("alice")


def test_streams_made_outside_a_call_belong_to_no_caller():
    assert ClientStream(1 << 20, 1 << 20).share is None
