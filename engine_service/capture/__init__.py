"""Activation capture inside vLLM workers, and its driver side.

Pure modules (no vLLM import): `row_mapping` (which batch rows to copy each
step), `merge` (combining every worker's shipment into ordered blocks, exactly
once) and `topology` (which rank owns which layer; request validation).
vLLM-facing modules: `worker_extension` (runs in each worker process),
`controller` (runs next to AsyncLLM) and `graphs` (keeps the capture sites
running where vLLM replays CUDA graphs).
"""

from common.errors import FailedPrecondition


class CaptureUnavailable(FailedPrecondition):
    """The engine's configuration cannot be captured faithfully; the message names
    the setting."""
