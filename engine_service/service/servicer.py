"""The Engine gRPC servicer: a thin layer over EngineRuntime.

Errors raised by the runtime are domain errors; the interceptor in
common.errors maps them to status codes in one place. Request ids belong to
the authenticated caller that uses them: another caller's request of the same
id is another request, and its Abort cannot reach this one. Each request counts
against its caller's quotas and carries its prefix-cache salt
(engine_service.request.callers); the OpenAI API serves its streams the same
way (`generate_for`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from common.security.auth import current_caller
from engine_service.request.callers import Callers
from engine_service.service.runtime import EngineRuntime
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc


async def generate_for(runtime: EngineRuntime, callers: Callers, caller: str,
                       request: engine_pb.GenerateRequest) -> AsyncIterator[engine_pb.GenerateResponse]:
    """One Generate stream of an authenticated caller, held against its quotas
    and with its cache salt: what every API of the engine serves."""
    with callers.stream(caller):
        async for response in runtime.generate(request, caller=caller, cache_salt=callers.cache_salt(caller)):
            yield response


class EngineServicer(engine_pb_grpc.EngineServiceServicer):
    def __init__(self, runtime: EngineRuntime, callers: Callers | None = None):
        self.runtime = runtime
        self.callers = callers or Callers()

    async def Generate(self, request, context):
        async for response in generate_for(self.runtime, self.callers, current_caller(), request):
            yield response

    async def Abort(self, request, context):
        return engine_pb.AbortResponse(found=await self.runtime.abort(request.request_id, caller=current_caller()))

    async def GetModelInfo(self, request, context):
        return engine_pb.GetModelInfoResponse(model=self.runtime.model_info())
