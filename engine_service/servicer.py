"""The Engine gRPC servicer: a thin layer over EngineRuntime.

Errors raised by the runtime are domain errors; the interceptor in
common.errors maps them to status codes in one place.
"""

from __future__ import annotations

from engine_service.runtime import EngineRuntime
from undercurrent.v1 import undercurrent_pb2 as pb
from undercurrent.v1 import undercurrent_pb2_grpc as pb_grpc


class EngineServicer(pb_grpc.EngineServiceServicer):
    def __init__(self, runtime: EngineRuntime):
        self.runtime = runtime

    async def Generate(self, request, context):
        async for response in self.runtime.generate(request):
            yield response

    async def Abort(self, request, context):
        return pb.AbortResponse(found=await self.runtime.abort(request.request_id))

    async def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(model=self.runtime.model_info())
