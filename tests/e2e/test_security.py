"""The engine process over TLS: tokens, plaintext refused, and per-caller isolation."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tools import stack
from tools.dev_security import DevSecurity
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc

pytestmark = pytest.mark.vllm


def long_request(rid: str, max_tokens: int = 900) -> engine_pb.GenerateRequest:
    """900 tokens: a request that ran to its end shows all of them."""
    return engine_pb.GenerateRequest(request_id=rid, text="one caller's request",
                              sampling=engine_pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


async def test_request_ids_belong_to_their_caller(engine_service):
    other_token = DevSecurity.ensure().other_client_token
    async with stack.channel(engine_service.address) as mine, \
            stack.channel(engine_service.address, token=other_token) as theirs:
        owner, other = engine_pb_grpc.EngineServiceStub(mine), engine_pb_grpc.EngineServiceStub(theirs)
        await other.GetModelInfo(engine_pb.GetModelInfoRequest())  # connected before the request starts
        with stack.vllm_paused(engine_service):  # so the request still runs when the other caller comes
            outcome = stack.Outcome()
            running = asyncio.create_task(stack.generate(owner, long_request("mine"), outcome=outcome))
            await stack.until_started(outcome, running)
            # To the other caller the running request does not exist: its Abort
            # finds nothing, and its request of the same id is a request of its own.
            assert not (await other.Abort(engine_pb.AbortRequest(request_id="mine"))).found
            theirs_outcome = stack.Outcome()
            same_id = asyncio.create_task(stack.generate(other, long_request("mine", max_tokens=2),
                                                         outcome=theirs_outcome))
            await stack.until_started(theirs_outcome, same_id)
            assert theirs_outcome.request_id == "mine"
        theirs_finished = await same_id
        assert theirs_finished.reason == "LENGTH" and len(theirs_finished.tokens) == 2
        # ... and the first finishes untouched.
        finished = await running
        assert finished.reason == "LENGTH" and len(finished.tokens) == 900
        # Its owner can abort its own requests.
        with stack.vllm_paused(engine_service):
            again = stack.Outcome()
            owned = asyncio.create_task(stack.generate(owner, long_request("owned"), outcome=again))
            await stack.until_started(again, owned)
            assert (await owner.Abort(engine_pb.AbortRequest(request_id="owned"))).found
        aborted = await owned
        assert aborted.reason == "CLIENT_ABORT" and len(aborted.tokens) < 900, aborted.finished


async def test_the_engine_refuses_a_missing_or_wrong_token_and_plaintext(engine_service):
    address = engine_service.address
    security = DevSecurity.ensure()
    ca_only = grpc.ssl_channel_credentials(security.ca.read_bytes())
    async with grpc.aio.secure_channel(address, ca_only) as no_token:
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stack.generate(engine_pb_grpc.EngineServiceStub(no_token), long_request("anon", 2))
    async with stack.channel(address, token=security.admin_token) as admin_token:
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await engine_pb_grpc.EngineServiceStub(admin_token).GetModelInfo(engine_pb.GetModelInfoRequest())
    async with grpc.aio.insecure_channel(address) as plaintext:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await engine_pb_grpc.EngineServiceStub(plaintext).GetModelInfo(engine_pb.GetModelInfoRequest(), timeout=10)
    assert (missing.value.code(), wrong.value.code(), refused.value.code()) == (
        grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE)
