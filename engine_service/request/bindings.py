"""A request's probe bindings as the engine pins them: each to one probe
version (the one loaded on the replica the request will live on), its failure
policy and action filled in, and what the version reads. Plain logic."""

from __future__ import annotations

from collections.abc import Sequence

from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

from common.capture_spec import TokenSelector
from common.errors import InvalidArgument
from engine_service.link.assignment import Wanted
from engine_service.request.ledger import LedgerBinding
from engine_service.request.probe_points import binding_points

CLOSED = types_pb.FAILURE_POLICY_FAIL_CLOSED


def check_names(bindings: Sequence[types_pb.ProbeBinding]) -> None:
    """INVALID_ARGUMENT names a binding without a probe or a probe bound twice."""
    seen: dict[str, int] = {}
    for i, binding in enumerate(bindings):
        if not binding.probe:
            raise InvalidArgument(f"probes[{i}].probe: empty; name a probe the routers loaded")
        if binding.probe in seen:
            raise InvalidArgument(f"probes[{i}].probe: {binding.probe!r} is bound twice "
                                  f"(also probes[{seen[binding.probe]}])")
        seen[binding.probe] = i


def wanted(bindings: Sequence[types_pb.ProbeBinding], default_failure_policy: int) -> list[Wanted]:
    """The bindings as homing sees them (their names checked)."""
    check_names(bindings)
    return [Wanted(b.probe, None, (b.failure_policy or default_failure_policy) == CLOSED) for b in bindings]


def pinned(bindings: Sequence[types_pb.ProbeBinding], infos: Sequence[types_pb.ProbeInfo],
           default_failure_policy: int) -> Sequence[session_pb.SessionBinding]:
    """Each binding pinned to its probe version's digest, policy and action filled in.

    They come back as one message's repeated field, which the request and the
    router link keep while it runs: one object for any number of bindings,
    where a list of messages is one object per binding for the garbage
    collector to walk at each full collection, on the event loop."""
    start = session_pb.RequestStart()
    for binding, info in zip(bindings, infos):
        start.bindings.add(
            probe=binding.probe,
            failure_policy=binding.failure_policy or default_failure_policy,
            action=binding.action or info.action or types_pb.PROBE_ACTION_OBSERVE,
            digest=info.digest,
        )
    return start.bindings


def for_ledger(bindings: Sequence[session_pb.SessionBinding], infos: Sequence[types_pb.ProbeInfo]) -> list[LedgerBinding]:
    """What the ledger needs of each pinned binding: which rows its version reads."""
    return [
        LedgerBinding(binding.probe, binding.failure_policy == CLOSED, info.stateful, binding_points(info),
                      TokenSelector.from_proto(info.tokens))
        for binding, info in zip(bindings, infos)
    ]
