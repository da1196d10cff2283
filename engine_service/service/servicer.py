"""The Engine gRPC servicer: a thin layer over EngineRuntime.

Errors raised by the runtime are domain errors; the interceptor in
common.errors maps them to status codes in one place. Each request belongs to
the authenticated caller that started it (engine_service.request.ownership),
counts against that caller's quotas and carries its prefix-cache salt
(engine_service.request.callers).
"""

from __future__ import annotations

from common.security.auth import current_caller
from engine_service.request.callers import Callers
from engine_service.request.ownership import RequestOwners
from engine_service.request.validation import request_id_of
from engine_service.service.runtime import EngineRuntime
from undercurrent.v1 import undercurrent_pb2 as pb
from undercurrent.v1 import undercurrent_pb2_grpc as pb_grpc


class EngineServicer(pb_grpc.EngineServiceServicer):
    def __init__(self, runtime: EngineRuntime, callers: Callers | None = None):
        self.runtime = runtime
        self.owners = RequestOwners()
        self.callers = callers or Callers()

    async def Generate(self, request, context):
        caller = current_caller()
        request.request_id = request_id_of(request)  # the id its owner is recorded under
        with self.owners.claim(request.request_id, caller), self.callers.stream(caller):
            async for response in self.runtime.generate(request, cache_salt=self.callers.cache_salt(caller)):
                yield response

    async def Abort(self, request, context):
        if not self.owners.visible_to(request.request_id, current_caller()):
            return pb.AbortResponse(found=False)  # another caller's: as if unknown
        return pb.AbortResponse(found=await self.runtime.abort(request.request_id))

    async def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(model=self.runtime.model_info())
