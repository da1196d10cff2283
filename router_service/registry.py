"""The probes loaded in one router, and who is using them.

Requests hold a probe from request_start to request_end (`acquire`/`release`).
An unload of a probe in use waits for its requests to end unless forced; a
replaced probe keeps serving the requests that started on it. Listeners hear
about every change to the list (the Session servicer turns that into catalogs).
"""

from __future__ import annotations

import logging
from typing import Callable

from common.errors import AlreadyExists, FailedPrecondition, NotFound
from common.probe_format.probes import Probe
from undercurrent.v1 import types_pb2 as types_pb

log = logging.getLogger(__name__)


class ProbeRegistry:
    def __init__(self) -> None:
        self._probes: dict[str, Probe] = {}
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Calls listener after each change; returns the unsubscribe function."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def __len__(self) -> int:
        return len(self._probes)

    def probes(self) -> list[Probe]:
        return sorted(self._probes.values(), key=lambda p: p.name)

    def load(self, probe: Probe, replace: bool = False) -> Probe:
        old = self._probes.get(probe.name)
        if old is not None:
            if not replace:
                raise AlreadyExists(
                    f"probe {probe.name!r} is already loaded (version {old.manifest.version!r}); "
                    "set replace to swap it"
                )
        self._probes[probe.name] = probe
        log.info(
            "probe loaded",
            extra={"probe": probe.name, "version": probe.manifest.version, "source": probe.source,
                   "replaced": old is not None},
        )
        self._changed()
        return probe

    def unload(self, name: str, force: bool = False) -> bool:
        """True when the probe is gone now; False when it waits for its requests."""
        probe = self._probes.get(name)
        if probe is None:
            raise NotFound(f"probe {name!r} is not loaded")
        if probe.active_requests and not force:
            probe.unloading = True
            log.info("probe unload waits for requests", extra={"probe": name,
                     "active_requests": probe.active_requests})
            self._changed()
            return False
        self._remove(probe, forced=bool(probe.active_requests))
        return True

    def bind(self, name: str, digest: str) -> Probe:
        """The probe a new request may use, in the version `digest` names; raises
        NotFound or FailedPrecondition (another version is loaded, or it unloads)."""
        probe = self._probes.get(name)
        if probe is None:
            raise NotFound(f"probe {name!r} is not loaded on this router")
        if probe.digest != digest:
            raise FailedPrecondition(
                f"probe {name!r} is version {probe.manifest.version!r} ({probe.digest}) on this router; "
                f"the request was bound to {digest or 'no digest'}")
        if probe.unloading:
            raise FailedPrecondition(f"probe {name!r} is being unloaded; it takes no new requests")
        probe.active_requests += 1
        return probe

    def release(self, probe: Probe) -> None:
        probe.active_requests -= 1
        if probe.active_requests == 0 and probe.unloading and self._probes.get(probe.name) is probe:
            self._remove(probe, forced=False)

    def info(self, probe: Probe) -> types_pb.ProbeInfo:
        m = probe.manifest
        return types_pb.ProbeInfo(
            name=m.name,
            kind=m.kind,
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
        )

    def _remove(self, probe: Probe, forced: bool) -> None:
        del self._probes[probe.name]
        probe.retired = True
        log.info("probe unloaded", extra={"probe": probe.name, "forced": forced,
                 "active_requests": probe.active_requests})
        self._changed()

    def _changed(self) -> None:
        for listener in list(self._listeners):
            listener()
