"""One step's captured rows, gathered on the model's device into one buffer and
brought to the host with one copy.

A site gathers its selected rows at once (vLLM's norms later work in place on
the tensor it saw) into its slice of the step's buffer; the offsets are fixed
when the step is planned. On a GPU, the alternative, a fresh `.cpu()` per site
and point, synchronises the host with the device at every site (4 per layer
with every tensor type), so the host could no longer queue the next layer's
kernels while the device runs this one; here the step's row indexes go to the
device once and its rows come back once, after the forward pass. On CPU the
buffer is the host copy: one allocation per step, and the rows each site
gathers are the rows that ship, without a further copy.

Needs torch and numpy only, so it is tested without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_service.capture.worker.row_mapping import PointRows

SiteKey = tuple[str, int]  # (tensor type, layer)
_BufferKey = tuple[torch.dtype, tuple[int, ...]]  # (dtype, shape of one row)


@dataclass(frozen=True)
class StagedRows:
    """Where one point's rows from one site go in the step's buffer."""

    point_rows: PointRows
    offset: int
    index: torch.Tensor  # int64 row indexes into the site's tensor, on the model's device


class StepStaging:
    def __init__(self, joined: dict[SiteKey, list[PointRows]], device: torch.device | str) -> None:
        # A point's layers share one index array (RowMapper.plan): each distinct
        # array goes to the device once, in one host-to-device copy for the step.
        distinct: dict[int, tuple[np.ndarray, int]] = {}  # id(row_indices) -> (it, start)
        size = 0
        for entries in joined.values():
            for rows in entries:
                if id(rows.row_indices) not in distinct:
                    distinct[id(rows.row_indices)] = (rows.row_indices, size)
                    size += len(rows.row_indices)
        arrays = [array for array, _ in distinct.values()]
        indexes = torch.from_numpy(np.concatenate(arrays) if arrays else np.empty(0, np.int64))
        indexes = indexes.to(device, non_blocking=True)
        self.plan: dict[SiteKey, list[StagedRows]] = {}
        offset = 0  # into the step's buffer: every (point, layer) has rows of its own
        for key, entries in joined.items():
            staged = []
            for rows in entries:
                count = len(rows.row_indices)
                start = distinct[id(rows.row_indices)][1]
                staged.append(StagedRows(rows, offset, indexes[start : start + count]))
                offset += count
            self.plan[key] = staged
        self.rows = offset
        # One buffer per (dtype, row shape) a site brought; a model's sites share one.
        self._buffers: dict[_BufferKey, torch.Tensor] = {}
        self._gathered: list[tuple[StagedRows, _BufferKey]] = []

    def gather(self, staged: StagedRows, tensor: torch.Tensor, addend: torch.Tensor | None = None) -> None:
        """Copies the point's rows of `tensor` (plus the same rows of `addend`) into its slice."""
        key = (tensor.dtype, tuple(tensor.shape[1:]))
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.empty(
                (self.rows, *key[1]), dtype=tensor.dtype, device=tensor.device
            )
        target = buffer[staged.offset : staged.offset + len(staged.index)]
        torch.index_select(tensor.detach(), 0, staged.index, out=target)
        if addend is not None:
            target += addend.detach().index_select(0, staged.index)
        self._gathered.append((staged, key))

    def collect(self) -> list[tuple[PointRows, np.ndarray, str]]:
        """The rows of every gather so far, as host numpy arrays with their wire
        dtype (bfloat16 as its bits): one device-to-host copy per buffer."""
        host = {key: _as_numpy(buffer.cpu()) for key, buffer in self._buffers.items()}
        collected = []
        for staged, key in self._gathered:
            array, dtype = host[key]
            # A slice of the buffer's one array: the push sends that array as one frame.
            collected.append((staged.point_rows, array[staged.offset : staged.offset + len(staged.index)], dtype))
        self._gathered = []
        return collected


def _as_numpy(buffer: torch.Tensor) -> tuple[np.ndarray, str]:
    """A host buffer as numpy, without a copy, and its wire dtype (bfloat16 as its bits)."""
    if buffer.dtype == torch.bfloat16:
        return buffer.view(torch.int16).numpy().view(np.uint16), "bfloat16"
    array = buffer.numpy()
    return array, array.dtype.name
