"""Small real gRPC routers (grpc.aio servers speaking the Session protocol) for
faults a production router should never produce on purpose: an error for every
batch, and a record of every (request, layer, position) key that arrives.
Built on the router-link tests' RouterDouble (hello, heartbeats, request
start/end, acks after scores)."""

from __future__ import annotations

from collections import defaultdict

from common.activations import from_batch
from tools.dev_security import DevSecurity
from tools.router_double import RouterDouble
from google.rpc import code_pb2
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

LAYERS = [0, 1, 2, 3]


def probe_info(name: str, layers=LAYERS) -> types_pb.ProbeInfo:
    """An observe probe on the residual stream of `layers` for every generated token."""
    return types_pb.ProbeInfo(
        name=name, kind=types_pb.PROBE_KIND_NORM, tensor_type=types_pb.TENSOR_TYPE_RESIDUAL_STREAM,
        layers=list(layers), hidden_size=128, dtype="float32", action=types_pb.PROBE_ACTION_OBSERVE, threshold=1e9,
        version="1", tokens=types_pb.TokenSelector(scope=types_pb.TokenSelector.SCOPE_GENERATED),
    )


class _TLSRouterDouble(RouterDouble):
    """A RouterDouble served with the development router certificate, as the
    engine of the fault tests (TLS by default) expects of every router."""

    async def start(self, port: int = 0, security=None) -> RouterDouble:
        return await super().start(port, security or DevSecurity.ensure().router_server_security())


class KeyRecordingRouter(_TLSRouterDouble):
    """Scores nothing; records every row's key, batch by batch, and acks each step."""

    def __init__(self, probe: str = "keys") -> None:
        super().__init__("key-recorder", probes=[probe_info(probe)], heartbeat_s=0.5)
        # request id -> one list of (position, layer) keys per batch, in arrival order
        self.keys: dict[str, list[list[tuple[int, int]]]] = defaultdict(list)

    def _score(self, batch: types_pb.ActivationBatch) -> list[session_pb.SessionResponse]:
        arrived: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for block in from_batch(batch):
            for request_id, position in zip(block.request_ids, block.token_positions):
                arrived[request_id].append((int(position), block.layer))
        for request_id, keys in arrived.items():
            self.keys[request_id].append(keys)
        return [session_pb.SessionResponse(ack=session_pb.StepAck(step=batch.step))]


class ErroringRouter(_TLSRouterDouble):
    """Answers hello, then every batch with an INTERNAL RequestError per request
    in it, followed by the step's ack: the router processed the step, and failed."""

    def __init__(self, probe: str = "fails") -> None:
        super().__init__("erroring", probes=[probe_info(probe)], heartbeat_s=0.5)
        self.probe = probe
        self.errors_sent = 0
        self.errored: set[str] = set()  # the requests that were sent an error

    def _score(self, batch: types_pb.ActivationBatch) -> list[session_pb.SessionResponse]:
        replies = []
        for request_id in dict.fromkeys(r for b in from_batch(batch) for r in b.request_ids):
            self.errors_sent += 1
            self.errored.add(request_id)
            replies.append(self._error(request_id, code_pb2.INTERNAL, "probe evaluation failed",
                                       probe=self.probe, step=batch.step))
        replies.append(session_pb.SessionResponse(ack=session_pb.StepAck(step=batch.step)))
        return replies
