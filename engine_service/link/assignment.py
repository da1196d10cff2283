"""Which replica a request lives on, which probe versions it is bound to, and
how fast a lost session retries. Plain logic.

A replica's catalog lists each probe's serving version, with the canary beside
it when the probe is rolling out: a new request is pinned to the canary when
the canary's hash takes it (common.canary), so the version that scores a
binding is always the one the engine pinned and reports."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from undercurrent.v1 import types_pb2 as types_pb

from common.canary import canary_takes
from common.errors import FailedPrecondition, NotFound

# A replica's probes by name, as its latest catalog listed them.
Catalog = Mapping[str, types_pb.ProbeInfo]


@dataclass(frozen=True)
class Wanted:
    """A binding as homing sees it: its probe, the digest it is pinned to (None
    before it is pinned), and whether it is fail_closed."""

    probe: str
    digest: str | None
    fail_closed: bool


def rendezvous_weight(key: str, replica: str) -> int:
    """A stable pseudo-random weight of (key, replica); the same in every process."""
    digest = hashlib.blake2b(f"{replica}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def pick_replica(key: str, replicas: Iterable[str]) -> str | None:
    """Highest-random-weight choice: removing a replica moves only the keys it held."""
    return max(replicas, key=lambda r: (rendezvous_weight(key, r), r), default=None)


def serves(catalog: Catalog, wanted: Wanted) -> bool:
    """Whether the replica takes the binding at its pinned version (the serving one or its canary)."""
    info = catalog.get(wanted.probe)
    if info is None or info.unloading:
        return False
    return wanted.digest in (None, info.digest) or (info.HasField("canary") and info.canary.digest == wanted.digest)


def version_for(key: str, info: types_pb.ProbeInfo) -> types_pb.ProbeInfo:
    """The version of a listed probe a new request is pinned to: its canary when
    the canary's hash takes the request, else the serving version."""
    if info.HasField("canary") and canary_takes(key, info.canary.canary_share):
        return info.canary
    return info


def choose_home(key: str, catalogs: Mapping[str, Catalog], wanted: Sequence[Wanted]) -> str | None:
    """The replica for a request, by rendezvous hashing over the replicas that
    serve every binding (at its pinned version); failing that, over those that
    serve every fail_closed binding; failing that, over all of them (the
    replica then refuses what it lacks, and each binding's policy applies)."""
    for required in (wanted, [w for w in wanted if w.fail_closed]):
        able = [address for address, catalog in catalogs.items() if all(serves(catalog, w) for w in required)]
        if able:
            return pick_replica(key, able)
    return pick_replica(key, catalogs)


def pin_versions(key: str, catalogs: Mapping[str, Catalog], wanted: Sequence[Wanted]) -> list[types_pb.ProbeInfo]:
    """The probe version each binding of a new request is pinned to: the one
    loaded on the replica it will live on (`choose_home`), or its canary there
    (`version_for`). A fail_open binding that replica lacks takes another
    replica's version (that replica refuses it and its rows count unprobed).
    NotFound names a probe no replica serves; FailedPrecondition says when no
    replica serves every fail_closed probe."""
    for i, w in enumerate(wanted):
        if not any(serves(c, w) for c in catalogs.values()):
            known = sorted({name for c in catalogs.values() for name, info in c.items() if not info.unloading})
            raise NotFound(f"probes[{i}].probe: {w.probe!r} is not loaded in any reachable router "
                           f"(loaded: {', '.join(known) or 'none'})")
    closed = [w for w in wanted if w.fail_closed]
    if not any(all(serves(c, w) for w in closed) for c in catalogs.values()):
        where = "; ".join(f"{a} has {', '.join(sorted(n for n in c if any(w.probe == n for w in closed))) or 'none'}"
                          for a, c in sorted(catalogs.items()))
        raise FailedPrecondition(
            "probes: no router replica serves every fail_closed probe of the request together "
            f"({', '.join(w.probe for w in closed)}): {where}")
    home = catalogs[choose_home(key, catalogs, wanted)]
    pinned = []
    for w in wanted:
        info = home.get(w.probe)
        if info is None or not serves(home, w):
            info = next(c[w.probe] for _, c in sorted(catalogs.items()) if serves(c, w))
        pinned.append(version_for(key, info))
    return pinned


def backoff_delay(attempt: int, base: float, maximum: float, unit_random: float) -> float:
    """Exponential backoff with jitter in [cap/2, cap], so engines do not reconnect in step."""
    cap = min(maximum, base * (2 ** min(attempt, 32)))
    return cap * (0.5 + 0.5 * unit_random)
