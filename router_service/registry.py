"""The probes loaded in one router, and who is using them.

Requests hold a probe from request_start to request_end (`bind`/`release`).
An unload of a probe in use waits for its requests to end unless forced; a
replaced probe keeps serving the requests that started on it. Listeners hear
about every change to the list (the Session servicer turns that into catalogs).

Each probe name has one serving version and at most one candidate beside it, a
canary or a shadow (router_service.rollout). A new request binds the version
the engine pinned: the serving one (plus its shadow, if there is one), or the
canary, which engines' catalogs list beside the serving version and engines pin
for the requests its hash takes. Promote and roll back change what NEW requests
bind; a request keeps the versions it bound until it ends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from common.probe_format.manifest import KIND_VALUES
from common.probe_format.probes import Probe
from router_service import rollout
from undercurrent.v1 import types_pb2 as types_pb


@dataclass(frozen=True)
class Candidate:
    probe: Probe
    role: int  # rollout.CANARY or rollout.SHADOW
    share: float = 0.0  # a canary's share of new requests


@dataclass(frozen=True)
class Bound:
    """What a new request binds for one probe name."""

    probe: Probe  # acts for the request: the serving version or the canary
    role: int
    shadow: Probe | None = None  # scores beside it, never acts


log = logging.getLogger(__name__)


class ProbeRegistry:
    def __init__(self) -> None:
        self._probes: dict[str, Probe] = {}  # the serving versions
        self._candidates: dict[str, Candidate] = {}
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Calls listener after each change; returns the unsubscribe function."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def __len__(self) -> int:
        return len(self._probes)

    def probes(self) -> list[Probe]:
        """The serving versions."""
        return sorted(self._probes.values(), key=lambda p: p.name)

    def candidates(self) -> list[Candidate]:
        return sorted(self._candidates.values(), key=lambda c: c.probe.name)

    def load(self, probe: Probe, replace: bool = False, role: int = rollout.SERVING, share: float = 0.0) -> Probe:
        if reason := rollout.check_share(role, share):
            raise InvalidArgument(reason)
        if role in (rollout.CANARY, rollout.SHADOW):
            return self._load_candidate(Candidate(probe, role, share), replace)
        old = self._probes.get(probe.name)
        if old is not None:
            if not replace:
                raise AlreadyExists(
                    f"probe {probe.name!r} is already loaded (version {old.manifest.version!r}); "
                    "set replace to swap it"
                )
            if (candidate := self._candidates.get(probe.name)) is not None:
                raise FailedPrecondition(self._in_rollout(candidate, "replace its serving version"))
        self._probes[probe.name] = probe
        log.info(
            "probe loaded",
            extra={"probe": probe.name, "version": probe.manifest.version, "source": probe.source,
                   "replaced": old is not None},
        )
        self._changed()
        return probe

    def _load_candidate(self, candidate: Candidate, replace: bool) -> Probe:
        probe, name = candidate.probe, candidate.probe.name
        serving = self._probes.get(name)
        what = rollout.ROLE_NAMES[candidate.role]
        if serving is None:
            raise NotFound(f"probe {name!r} is not loaded; a {what} stands beside a serving version")
        if serving.unloading:
            raise FailedPrecondition(f"probe {name!r} is being unloaded; it takes no {what}")
        if probe.digest == serving.digest:
            raise FailedPrecondition(f"probe {name!r}: the {what} is the serving version itself ({probe.digest})")
        if (old := self._candidates.get(name)) is not None and not replace:
            raise AlreadyExists(self._in_rollout(old, f"load a {what}") + "; or set replace to swap it")
        if reason := rollout.reads_differ(serving.manifest, probe.manifest):
            raise InvalidArgument(reason)
        self._candidates[name] = candidate
        log.info("probe candidate loaded", extra={"probe": name, "version": probe.manifest.version,
                                                  "role": what, "share": candidate.share})
        self._changed()
        return probe

    def promote(self, name: str) -> Probe:
        """The candidate serves new requests; the old serving version keeps the requests bound to it."""
        candidate = self._candidate(name, "promote")
        old = self._probes[name]
        del self._candidates[name]
        self._probes[name] = candidate.probe
        log.info("probe promoted", extra={"probe": name, "version": candidate.probe.manifest.version,
                                          "replaced_version": old.manifest.version})
        self._changed()
        return candidate.probe

    def roll_back(self, name: str) -> Probe:
        """New requests bind the serving version alone; requests bound to the candidate keep it."""
        candidate = self._candidate(name, "roll back")
        del self._candidates[name]
        log.info("probe rolled back", extra={"probe": name, "version": candidate.probe.manifest.version,
                                             "role": rollout.ROLE_NAMES[candidate.role]})
        self._changed()
        return self._probes[name]

    def _candidate(self, name: str, doing: str) -> Candidate:
        if name not in self._probes:
            raise NotFound(f"probe {name!r} is not loaded")
        candidate = self._candidates.get(name)
        if candidate is None:
            raise FailedPrecondition(f"probe {name!r} has no canary or shadow to {doing}")
        return candidate

    @staticmethod
    def _in_rollout(candidate: Candidate, doing: str) -> str:
        return (f"probe {candidate.probe.name!r} has a {rollout.ROLE_NAMES[candidate.role]} (version "
                f"{candidate.probe.manifest.version!r}); promote or roll it back before you {doing}")

    def unload(self, name: str, force: bool = False) -> bool:
        """True when the probe is gone now; False when it waits for its requests."""
        probe = self._probes.get(name)
        if probe is None:
            raise NotFound(f"probe {name!r} is not loaded")
        if (candidate := self._candidates.get(name)) is not None:
            raise FailedPrecondition(self._in_rollout(candidate, "unload it"))
        if probe.active_requests and not force:
            probe.unloading = True
            log.info("probe unload waits for requests", extra={"probe": name,
                     "active_requests": probe.active_requests})
            self._changed()
            return False
        self._remove(probe, forced=bool(probe.active_requests))
        return True

    def bind(self, name: str, digest: str) -> Bound:
        """What a new request binds for the probe, at the version `digest` names
        (the serving version or its canary); raises NotFound or FailedPrecondition
        (that version is not loaded here, or the probe unloads). Release each
        probe of it at the end."""
        probe = self._probes.get(name)
        if probe is None:
            raise NotFound(f"probe {name!r} is not loaded on this router")
        candidate = self._candidates.get(name)
        if candidate is not None and candidate.role == rollout.CANARY and candidate.probe.digest == digest:
            bound = Bound(candidate.probe, rollout.CANARY)
        elif probe.digest != digest:
            canary = (f" (its canary: version {candidate.probe.manifest.version!r}, {candidate.probe.digest})"
                      if candidate is not None and candidate.role == rollout.CANARY else "")
            raise FailedPrecondition(
                f"probe {name!r} is version {probe.manifest.version!r} ({probe.digest}){canary} on this router; "
                f"the request was bound to {digest or 'no digest'}")
        elif probe.unloading:
            raise FailedPrecondition(f"probe {name!r} is being unloaded; it takes no new requests")
        elif candidate is not None and candidate.role == rollout.SHADOW:
            bound = Bound(probe, rollout.SERVING, shadow=candidate.probe)
        else:
            bound = Bound(probe, rollout.SERVING)
        for held in (bound.probe, bound.shadow):
            if held is not None:
                held.active_requests += 1
        return bound

    def release(self, probe: Probe) -> None:
        probe.active_requests -= 1
        if probe.active_requests == 0 and probe.unloading and self._probes.get(probe.name) is probe:
            self._remove(probe, forced=False)

    def info(self, probe: Probe) -> types_pb.ProbeInfo:
        candidate = self._candidates.get(probe.name)
        if candidate is not None and candidate.probe is probe:
            role, share = candidate.role, candidate.share
        else:
            role, share = rollout.SERVING, 0.0
        m = probe.manifest
        return types_pb.ProbeInfo(
            name=m.name,
            kind=KIND_VALUES[m.kind],
            tensor_type=m.tensor_type,
            layers=list(m.layers),
            hidden_size=m.hidden_size,
            dtype=m.dtype,
            action=m.action,
            threshold=m.threshold,
            version=m.version,
            tokens=m.tokens.to_proto(),
            active_requests=probe.active_requests,
            unloading=probe.unloading,
            digest=probe.digest,
            stateful=probe.stateful,
            role=role,
            canary_share=share,
        )

    def catalog_info(self, probe: Probe) -> types_pb.ProbeInfo:
        """A serving version as engines' catalogs list it: with its canary, which
        the engine pins for the share of new requests the canary's hash takes."""
        info = self.info(probe)
        candidate = self._candidates.get(probe.name)
        if candidate is not None and candidate.role == rollout.CANARY:
            info.canary.CopyFrom(self.info(candidate.probe))
        return info

    def _remove(self, probe: Probe, forced: bool) -> None:
        del self._probes[probe.name]
        probe.retired = True
        log.info("probe unloaded", extra={"probe": probe.name, "forced": forced,
                 "active_requests": probe.active_requests})
        self._changed()

    def _changed(self) -> None:
        for listener in list(self._listeners):
            listener()
