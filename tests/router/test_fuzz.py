"""Fuzzing a real router over loopback: random, truncated, oversized and
out-of-order Session and ProbeAdmin messages, built from the message descriptors.

Every answer must be a proper status (never UNKNOWN or INTERNAL), in-band
errors must never be INTERNAL, the router must keep serving, and its state
(sessions, live requests, loaded probes) must be the same before and after.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
from google.rpc import code_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.activations import Block, to_batch
from common.grpc_server import channel_options
from tests.message_strategies import messages, wire_bytes
from tests.router.helpers import HIDDEN, LAYERS, linear_probe, model_info, start_router
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import router_session_pb2_grpc as session_pb_grpc

# Statuses a well-behaved service may answer hostile input with.
PROPER = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
          grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
          grpc.StatusCode.ALREADY_EXISTS}
IN_BAND = {code_pb2.INVALID_ARGUMENT, code_pb2.NOT_FOUND, code_pb2.RESOURCE_EXHAUSTED,
           code_pb2.FAILED_PRECONDITION, code_pb2.ALREADY_EXISTS}
MAX_MESSAGE_BYTES = 1024 * 1024
REQUEST_IDS = ("r1", "r2", "r3")
PROBES = ("watch", "stop", "absent")
# The digests of the probes the live router loaded (filled by its fixture): a
# request_start may name a probe at its version, at another, or at none.
LOADED_DIGESTS: dict[str, str] = {}
CASES = {"session": 0, "session_bytes": 0, "admin": 0}


class LiveRouter:
    """A router on its own event loop in a thread, so hypothesis drives it synchronously."""

    def __init__(self, probes_dir):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.router = self.run(start_router(probes_dir, max_sessions=4, max_requests_per_session=2,
                                            max_message_bytes=MAX_MESSAGE_BYTES))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.router.port}",
                                             options=channel_options(4 * MAX_MESSAGE_BYTES))

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def state(self) -> tuple:
        async def read():
            r = self.router
            gauge = r.metrics.registry.get_sample_value
            return (len(r.sessions), r.live_requests(), gauge("undercurrent_router_sessions"),
                    gauge("undercurrent_router_live_requests"),
                    sorted((p.name, p.manifest.version) for p in r.registry.probes()))
        return self.run(read())

    def settled_state(self, want: tuple, timeout: float = 10.0) -> tuple:
        """The state once closed sessions finished tearing down (or the last seen)."""
        deadline = time.monotonic() + timeout
        while (now := self.state()) != want and time.monotonic() < deadline:
            time.sleep(0.01)
        return now

    def close(self) -> None:
        self.channel.close()
        self.run(self.router.shutdown(grace_period=0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    probes = tmp_path_factory.mktemp("probes")
    linear_probe(probes, "watch", np.eye(HIDDEN)[0], kind="linear", threshold=0.0, action="observe",
                 tokens={"scope": "all"}, layers=[0, 1])
    linear_probe(probes, "stop", np.eye(HIDDEN)[1], kind="linear", threshold=1.0, action="abort",
                 tokens={"scope": "all"}, layers=[1])
    router = LiveRouter(probes)
    LOADED_DIGESTS.update({p.name: p.digest for p in router.router.registry.probes()})
    yield router
    router.close()
    print(f"\nrouter fuzz cases run: {CASES} (total {sum(CASES.values())})")


def hello() -> session_pb.SessionRequest:
    return session_pb.SessionRequest(hello=session_pb.SessionHello(engine_id="fuzz", model=model_info()))


@st.composite
def plausible_batches(draw) -> types_pb.ActivationBatch:
    """Batches close to what an engine sends: real encoding, any request ids,
    positions (negative too), layers, tensor types, NaN/Inf rows."""
    blocks = []
    for _ in range(draw(st.integers(0, 3))):
        n = draw(st.integers(0, 4))
        values = draw(st.lists(st.floats(width=32), min_size=n * HIDDEN, max_size=n * HIDDEN))
        blocks.append(Block(
            draw(st.sampled_from(["p", "__probe__", ""])),
            draw(st.integers(-1, 6)),
            draw(st.integers(-1, LAYERS + 1)),
            np.asarray(values, dtype=np.float32).reshape(n, HIDDEN),
            draw(st.lists(st.sampled_from(REQUEST_IDS + ("",)), min_size=n, max_size=n)),
            np.asarray(draw(st.lists(st.integers(-3, 40), min_size=n, max_size=n)), dtype=np.int64),
            np.asarray(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool),
            draw(st.sampled_from(["float32", "bfloat16", "float16"])),
        ))
    with np.errstate(over="ignore"):  # large float32 values become inf in float16, as intended
        batch = to_batch(blocks, step=draw(st.integers(0, 2**64 - 1)))
    if blocks and draw(st.booleans()):  # then break one field of one block
        target = batch.blocks[draw(st.integers(0, len(blocks) - 1))]
        damage = draw(st.sampled_from(["shape", "data", "index", "dtype", "positions"]))
        if damage == "shape":
            del target.rows.shape[:]
            target.rows.shape.extend(draw(st.lists(st.sampled_from([0, 1, -1, 2**32, 2**62, HIDDEN]), max_size=3)))
        elif damage == "data":
            target.rows.data = target.rows.data[: draw(st.integers(0, len(target.rows.data)))]
        elif damage == "index":
            target.request_index.append(draw(st.integers(0, 2**32 - 1)))
        elif damage == "dtype":
            target.rows.dtype = draw(st.text(max_size=8))
        else:
            del target.token_positions[:1]
    return batch


def session_messages() -> st.SearchStrategy[session_pb.SessionRequest]:
    start = st.builds(
        lambda rid, incarnation, bindings, prompt: session_pb.SessionRequest(request_start=session_pb.RequestStart(
            request_id=rid, incarnation=incarnation, prompt_tokens=prompt,
            bindings=[session_pb.SessionBinding(probe=name, failure_policy=policy, action=action,
                                        digest=LOADED_DIGESTS.get(name, "") if version == "loaded" else version)
                      for name, policy, action, version in bindings])),
        st.sampled_from(REQUEST_IDS + ("",)), st.integers(0, 3),
        st.lists(st.tuples(st.sampled_from(PROBES), st.integers(-1, 4), st.integers(-1, 4),
                           st.sampled_from(("loaded", "", "sha256:another"))), max_size=3),
        st.integers(-2, 8))
    end = st.builds(lambda rid, incarnation: session_pb.SessionRequest(request_end=session_pb.RequestEnd(
        request_id=rid, incarnation=incarnation)), st.sampled_from(REQUEST_IDS), st.integers(0, 3))
    batch = plausible_batches().map(lambda b: session_pb.SessionRequest(batch=b))
    anything = messages(session_pb.SessionRequest, names=REQUEST_IDS + PROBES)
    return st.one_of(start, end, batch, anything)


def read_session(call) -> list[session_pb.SessionResponse]:
    """Every reply until the router ends the stream; the status must be proper."""
    replies = []
    try:
        for reply in call:
            replies.append(reply)
    except grpc.RpcError as err:
        assert err.code() in PROPER, (err.code(), err.details())
    for reply in replies:
        if reply.WhichOneof("message") == "error":
            assert reply.error.code in IN_BAND, reply.error
    return replies


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(first=st.one_of(st.just(hello()), messages(session_pb.SessionRequest, names=PROBES)),
       body=st.lists(session_messages(), max_size=8))
def test_random_and_out_of_order_session_messages(live, first, body):
    CASES["session"] += 1
    before = live.settled_state(live.state())
    stub = session_pb_grpc.ProbeRouterServiceStub(live.channel)
    replies = read_session(stub.Session(iter([first, *body]), timeout=20))
    if first.WhichOneof("message") == "hello" and replies:
        acked = [r.ack.step for r in replies if r.WhichOneof("message") == "ack"]
        sent = [m.batch.step for m in body if m.WhichOneof("message") == "batch"]
        assert acked == sent  # every batch acked, in order, whatever it held
    assert live.settled_state(before) == before


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.lists(wire_bytes(session_pb.SessionRequest, names=REQUEST_IDS + PROBES), min_size=1, max_size=4),
       with_hello=st.booleans())
def test_random_truncated_and_padded_session_bytes(live, body, with_hello):
    CASES["session_bytes"] += 1
    before = live.settled_state(live.state())
    call = live.channel.stream_stream("/undercurrent.v1.ProbeRouterService/Session",
                                      response_deserializer=session_pb.SessionResponse.FromString)
    frames = [hello().SerializeToString()] * with_hello + body
    read_session(call(iter(frames), timeout=20))
    assert live.settled_state(before) == before


ADMIN = {
    "LoadProbe": admin_pb.LoadProbeRequest,
    "ListProbes": admin_pb.ListProbesRequest,
    "UnloadProbe": admin_pb.UnloadProbeRequest,
    "PromoteProbe": admin_pb.PromoteProbeRequest,
    "RollBackProbe": admin_pb.RollBackProbeRequest,
}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), method=st.sampled_from(sorted(ADMIN)), as_bytes=st.booleans())
def test_random_and_truncated_admin_calls(live, data, method, as_bytes):
    CASES["admin"] += 1
    before = live.state()
    cls = ADMIN[method]
    # Names that are not loaded: an unload of a real probe would rightly change state.
    payload = data.draw(wire_bytes(cls, names=("absent",)) if as_bytes
                        else messages(cls, names=("absent",)).map(lambda m: m.SerializeToString()))
    call = live.channel.unary_unary(f"/undercurrent.v1.ProbeAdminService/{method}")
    try:
        call(payload, timeout=20)
    except grpc.RpcError as err:
        assert err.code() in PROPER, (err.code(), err.details())
    assert live.state() == before


def test_oversized_messages_are_resource_exhausted_and_the_router_still_serves(live):
    before = live.settled_state(live.state())
    huge = admin_pb.LoadProbeRequest(path="x" * (MAX_MESSAGE_BYTES + 10)).SerializeToString()
    with pytest.raises(grpc.RpcError) as unary:
        live.channel.unary_unary("/undercurrent.v1.ProbeAdminService/LoadProbe")(huge, timeout=20)
    assert unary.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    big_batch = session_pb.SessionRequest(batch=types_pb.ActivationBatch(request_ids=["r1"] * (MAX_MESSAGE_BYTES // 3)))
    call = session_pb_grpc.ProbeRouterServiceStub(live.channel).Session(iter([hello(), big_batch]),
                                                                              timeout=20)
    with pytest.raises(grpc.RpcError) as streaming:
        list(call)
    assert streaming.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert live.settled_state(before) == before
    # Still serving: a clean session scores a row.
    stub = session_pb_grpc.ProbeRouterServiceStub(live.channel)
    rows = np.zeros((1, HIDDEN), np.float32)
    rows[0, 0] = 0.25
    batch = to_batch([Block("p", types_pb.TENSOR_TYPE_RESIDUAL_STREAM, 0, rows, ["ok"], np.array([0]),
                            np.array([True]))], step=1)
    replies = read_session(stub.Session(iter([
        hello(),
        session_pb.SessionRequest(request_start=session_pb.RequestStart(request_id="ok", bindings=[
            session_pb.SessionBinding(probe="watch", digest=LOADED_DIGESTS["watch"])])),
        session_pb.SessionRequest(batch=batch),
        session_pb.SessionRequest(request_end=session_pb.RequestEnd(request_id="ok")),
    ]), timeout=20))
    scores = [r.scores.probe_scores for r in replies if r.WhichOneof("message") == "scores"]
    assert [(list(s.token_positions), list(s.scores)) for s in scores] == [([0], [0.25])]
    assert live.settled_state(before) == before
