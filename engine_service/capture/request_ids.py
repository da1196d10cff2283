"""vLLM's forms of a request id, resolved back to the id capture registered.

Workers never see the caller's request id as it is: vLLM appends
"-<random hex>", and the children of an n>1 request are
"<index>_<id>-<random hex>". Workers map the ids they see to record ids with
`record_request_id`; the driver maps record ids to registrations with
`parent_request_id`. Plain logic.
"""

from __future__ import annotations

import re

_RANDOM_SUFFIX = re.compile(r"-[0-9a-fA-F]{8,}$")
_CHILD_PREFIX = re.compile(r"^(\d+)_(.+)$")


def record_request_id(internal_id: str, registered: set[str] | dict) -> str | None:
    """The id records of this vLLM-internal request carry, or None if unregistered.

    A plain request maps to the id it was registered under. A child of an n>1
    request maps to "<index>_<id>" (vLLM's own child naming), since each child
    samples different tokens at the same positions.
    """
    suffix = _RANDOM_SUFFIX.search(internal_id)
    candidates = [internal_id[: suffix.start()], internal_id] if suffix else [internal_id]
    for candidate in candidates:
        if candidate in registered:
            return candidate
        child = _CHILD_PREFIX.match(candidate)
        if child and child.group(2) in registered:
            return candidate
    return None


def parent_request_id(record_id: str, registered: set[str] | dict) -> str:
    """The registered id behind a record id (itself, or the parent of an n>1 child)."""
    if record_id in registered:
        return record_id
    child = _CHILD_PREFIX.match(record_id)
    return child.group(2) if child else record_id
