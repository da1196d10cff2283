"""Operator-set bindings ("guards"): probes the engine's operator binds to every
request of a caller, which the request cannot remove or weaken. Plain logic.

Without guards, a caller that binds no probe is never probed. An operator
running a guardrail needs the opposite, so the engine takes a policy file
(`--guards-file`, JSON) mapping callers to bindings:

    {"default": [{"probe": "norm_guard", "failure_policy": "fail_closed",
                  "action": "abort", "gate_tokens": true}],
     "callers": {"batch-jobs": [{"probe": "topic_watch", "failure_policy": "fail_open"}]}}

`default` applies to every caller, `callers` adds bindings for the callers
named (the names client tokens map to, common.security.tokens). Each guard
names a probe, its failure policy (default fail_closed), its action (default:
the probe's own) and whether it gates the caller's tokens (default false).

A request keeps its own bindings on top. Naming a guard's probe itself, it may
make the binding stronger (fail_closed, abort) but never weaker: a fail_open
policy under a fail_closed guard, observe under an abort guard (or under a
guard that leaves the action to the probe), or gate_tokens false while a guard
gates is INVALID_ARGUMENT naming the field. The same policy holds on every API
of the engine: both the gRPC API and the OpenAI API pass through
`EngineRuntime.generate`, which applies it.

The file is re-read when it changes, at the next request. A file that becomes
unreadable or malformed fails closed: every request is refused UNAVAILABLE
until it is fixed, since the guards it meant to set are unknown.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.enum_names import short_name
from common.errors import InvalidArgument, Unavailable
from common.watched_file import WatchedFile
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb

log = logging.getLogger(__name__)

CLOSED, OPEN = types_pb.FAILURE_POLICY_FAIL_CLOSED, types_pb.FAILURE_POLICY_FAIL_OPEN
OBSERVE, ABORT = types_pb.PROBE_ACTION_OBSERVE, types_pb.PROBE_ACTION_ABORT
UNSET_ACTION = types_pb.PROBE_ACTION_UNSPECIFIED
POLICIES = {"fail_closed": CLOSED, "fail_open": OPEN}
ACTIONS = {"abort": ABORT, "observe": OBSERVE}
GUARD_KEYS = {"probe", "failure_policy", "action", "gate_tokens"}


class GuardConfigError(ValueError):
    """The guards file is unusable (the message names the file and the entry)."""


@dataclass(frozen=True)
class Guard:
    """One operator-set binding."""

    probe: str
    failure_policy: int = CLOSED  # types_pb.FailurePolicy
    action: int = UNSET_ACTION  # types_pb.ProbeAction; unset: the probe's own
    gate_tokens: bool = False

    def stronger(self, other: "Guard") -> "Guard":
        """The binding that satisfies both guards of one probe."""
        return Guard(
            self.probe,
            CLOSED if CLOSED in (self.failure_policy, other.failure_policy) else OPEN,
            ABORT if ABORT in (self.action, other.action) else (self.action or other.action),
            self.gate_tokens or other.gate_tokens,
        )


@dataclass(frozen=True)
class GuardPolicy:
    default: tuple[Guard, ...] = ()
    callers: Mapping[str, tuple[Guard, ...]] = None  # type: ignore[assignment]

    def for_caller(self, caller: str) -> tuple[Guard, ...]:
        """The default guards and the caller's own, one per probe (the stronger of two)."""
        merged: dict[str, Guard] = {}
        for guard in (*self.default, *(self.callers or {}).get(caller, ())):
            known = merged.get(guard.probe)
            merged[guard.probe] = guard if known is None else known.stronger(guard)
        return tuple(merged.values())


def parse_policy(text: str, source: str) -> GuardPolicy:
    """The policy in a guards file's text; GuardConfigError names the entry."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise GuardConfigError(f"{source}: not JSON: {err}") from None
    if not isinstance(data, dict):
        raise GuardConfigError(f"{source}: must be a JSON object with 'default' and/or 'callers'")
    unknown = set(data) - {"default", "callers"}
    if unknown:
        raise GuardConfigError(f"{source}: unknown key(s) {sorted(unknown)}; expected 'default' and/or 'callers'")
    callers = data.get("callers", {})
    if not isinstance(callers, dict):
        raise GuardConfigError(f"{source}: callers: must map caller names to lists of guards")
    return GuardPolicy(
        default=_guards(data.get("default", []), f"{source}: default"),
        callers={name: _guards(guards, f"{source}: callers.{name}") for name, guards in callers.items()},
    )


def _guards(entries, where: str) -> tuple[Guard, ...]:
    if not isinstance(entries, list):
        raise GuardConfigError(f"{where}: must be a list of guards")
    guards = [_guard(entry, f"{where}[{i}]") for i, entry in enumerate(entries)]
    probes = [g.probe for g in guards]
    twice = sorted({p for p in probes if probes.count(p) > 1})
    if twice:
        raise GuardConfigError(f"{where}: probe(s) {twice} listed twice")
    return tuple(guards)


def _guard(entry, where: str) -> Guard:
    if not isinstance(entry, dict):
        raise GuardConfigError(f"{where}: must be an object with 'probe'")
    unknown = set(entry) - GUARD_KEYS
    if unknown:
        raise GuardConfigError(f"{where}: unknown key(s) {sorted(unknown)}; expected {sorted(GUARD_KEYS)}")
    probe = entry.get("probe")
    if not isinstance(probe, str) or not probe:
        raise GuardConfigError(f"{where}.probe: must name a probe")
    gate = entry.get("gate_tokens", False)
    if not isinstance(gate, bool):
        raise GuardConfigError(f"{where}.gate_tokens: must be true or false")
    return Guard(probe, _choice(entry, "failure_policy", POLICIES, "fail_closed", where),
                 _choice(entry, "action", ACTIONS, None, where), gate)


def _choice(entry: dict, key: str, choices: dict[str, int], default: str | None, where: str) -> int:
    value = entry.get(key, default)
    if value is None:
        return UNSET_ACTION
    if value not in choices:
        raise GuardConfigError(f"{where}.{key}: {value!r} is not one of {', '.join(choices)}")
    return choices[value]


@dataclass(frozen=True)
class Guarded:
    """A request with its caller's guards in force."""

    request: engine_pb.GenerateRequest  # guards' bindings first, then the request's own
    operator_probes: frozenset[str]


def apply(guards: Sequence[Guard], request: engine_pb.GenerateRequest) -> Guarded:
    """The request with the guards in force: its own bindings in its order
    (strengthened where a guard names the same probe), then the guards it did
    not name. INVALID_ARGUMENT names the field that would remove or weaken one."""
    if not guards:
        return Guarded(request, frozenset())
    by_probe = {guard.probe: guard for guard in guards}
    merged = engine_pb.GenerateRequest()
    merged.CopyFrom(request)
    del merged.probes[:]
    for i, binding in enumerate(request.probes):
        guard = by_probe.pop(binding.probe, None)
        if guard is None:
            merged.probes.add().CopyFrom(binding)
            continue
        _refuse_weaker(guard, binding, i)
        merged.probes.add(
            probe=guard.probe,
            failure_policy=CLOSED if CLOSED in (guard.failure_policy, binding.failure_policy) else OPEN,
            action=binding.action or guard.action,
        )
    for guard in by_probe.values():
        merged.probes.add(probe=guard.probe, failure_policy=guard.failure_policy, action=guard.action)
    gating = [g.probe for g in guards if g.gate_tokens]
    if gating:
        if request.HasField("gate_tokens") and not request.gate_tokens:
            raise InvalidArgument(
                f"gate_tokens: false, but the operator-set binding of {gating[0]!r} gates this caller's "
                "tokens; leave gate_tokens unset")
        merged.gate_tokens = True
    return Guarded(merged, frozenset(g.probe for g in guards))


def _refuse_weaker(guard: Guard, binding: types_pb.ProbeBinding, i: int) -> None:
    if guard.failure_policy == CLOSED and binding.failure_policy == OPEN:
        raise InvalidArgument(
            f"probes[{i}].failure_policy: FAIL_OPEN would weaken the operator-set binding of {guard.probe!r}, "
            "which is FAIL_CLOSED; leave it unset or set FAIL_CLOSED")
    if binding.action == OBSERVE and guard.action != OBSERVE:
        what = "ABORT" if guard.action == ABORT else "the probe's own action"
        raise InvalidArgument(
            f"probes[{i}].action: OBSERVE would weaken the operator-set binding of {guard.probe!r}, "
            f"whose action is {what}; leave it unset or set ABORT")


def describe(guard: Guard) -> str:
    """One guard for logs: probe, policy, action, gating."""
    action = short_name(types_pb.ProbeAction, guard.action) if guard.action else "probe's own"
    gate = ", gated" if guard.gate_tokens else ""
    return f"{guard.probe} ({short_name(types_pb.FailurePolicy, guard.failure_policy)}, {action}{gate})"


class GuardsFile:
    """The policy in --guards-file, re-read when the file changes; while the
    file is unusable every request is refused."""

    def __init__(self, path: Path):
        self.file = WatchedFile(Path(path))
        self.source = f"--guards-file {path}"
        self._policy = self._read()  # raises GuardConfigError: start-up fails
        self._broken: str | None = None

    def _read(self) -> GuardPolicy:
        try:
            text = self.file.read()
        except (OSError, UnicodeDecodeError) as err:  # the stamp stays: retried at every use
            raise GuardConfigError(f"{self.source}: {getattr(err, 'strerror', None) or err}") from None
        return parse_policy(text, self.source)

    def _refresh(self) -> None:
        if not self.file.changed():
            return
        try:
            policy = self._read()
        except GuardConfigError as err:
            if self._broken != str(err):
                self._broken = str(err)
                log.error("%s; refusing every request until it is fixed", err)
            return
        if self._broken is not None or policy != self._policy:
            log.info("guards reloaded from %s: default %s; %d caller(s)", self.file.path,
                     ", ".join(map(describe, policy.default)) or "none", len(policy.callers or {}))
        self._policy, self._broken = policy, None

    def for_caller(self, caller: str) -> tuple[Guard, ...]:
        """The caller's guards now; UNAVAILABLE while the file is unusable."""
        self._refresh()
        if self._broken is not None:
            raise Unavailable(f"the engine's guards file is unusable ({self._broken}); it serves no request "
                              "until the operator fixes it")
        return self._policy.for_caller(caller)
