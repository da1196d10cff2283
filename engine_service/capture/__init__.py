"""Activation capture: `worker/` runs in each vLLM worker process, `driver/`
in the engine service process; `channel` (how rows travel from one to the
other), `graphs` (the capture sites under vLLM's graph replay) and
`request_ids` (vLLM's forms of a request id) are shared by both. The pure
modules (row mapping, merge, topology, channel) import no vLLM and are tested
without it."""

from common.errors import FailedPrecondition


class CaptureUnavailable(FailedPrecondition):
    """The engine's configuration cannot be captured faithfully; the message names
    the setting."""
