"""Probe math, vectorised with numpy over all rows of a batch.

Every kind splits into two stages so that one batch costs one matrix product:
  1. a stateless per-row *form* (a linear form x.w + b, optionally through a
     sigmoid, or an L2 norm). The forms of every probe reading one block are
     stacked into one matrix and applied to all rows at once (`ProjectionPlan`);
  2. a per-request *score* over the form values in forward order, which carries
     trajectory state (EMA, rolling windows, counts) from batch to batch.
A binding's decision rule (threshold, min_tokens, patience) runs on the scores.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.signal import lfilter

from common import tensor_codec
from common.probe_format.manifest import AggregationSpec, Manifest, ManifestError, ScorerSpec


@dataclass(frozen=True)
class LinearForm:
    """x.weight + bias, with any standardisation (x - mean) / std folded in."""

    weight: np.ndarray  # float32 [hidden]
    bias: float
    sigmoid: bool


@dataclass(frozen=True)
class NormForm:
    """||x - center||_2."""

    center: np.ndarray | None


Form = LinearForm | NormForm


def sigmoid(z: np.ndarray) -> np.ndarray:
    # exp of a negative magnitude never overflows.
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


# ---------------------------------------------------------------------------
# Trajectory aggregations: vectorised within a batch, state carried across.
# ---------------------------------------------------------------------------


class Aggregation:
    def __init__(self, spec: AggregationSpec):
        self.spec = spec

    def new_state(self) -> dict:
        return {"last": None, "tail": np.zeros(0), "max": -np.inf, "count": 0}

    def apply(self, x: np.ndarray, state: dict) -> np.ndarray:
        """Running aggregate of x (one request's values in forward order)."""
        x = np.asarray(x, dtype=np.float64)
        if x.size == 0:
            return x
        kind = self.spec.kind
        if kind == "ema":
            return self._ema(x, state)
        if kind == "rolling_mean":
            return self._rolling_mean(x, state)
        if kind == "max_rolling_mean":
            running = np.maximum.accumulate(np.maximum(self._rolling_mean(x, state), state["max"]))
            state["max"] = running[-1]
            return running
        counts = state["count"] + np.cumsum(x >= self.spec.over)
        state["count"] = int(counts[-1])
        return counts.astype(np.float64)

    def _ema(self, x: np.ndarray, state: dict) -> np.ndarray:
        """y[i] = alpha * x[i] + (1 - alpha) * y[i-1]; the first value starts at x[0]."""
        alpha = self.spec.alpha
        previous = x[0] if state["last"] is None else state["last"]
        y, _ = lfilter([alpha], [1.0, alpha - 1.0], x, zi=[(1.0 - alpha) * previous])
        state["last"] = y[-1]
        return y

    def _rolling_mean(self, x: np.ndarray, state: dict) -> np.ndarray:
        """Mean of the last `window` values (fewer at the start of a request)."""
        window = self.spec.window
        history = np.concatenate([state["tail"], x])
        sums = np.concatenate([[0.0], np.cumsum(history)])
        ends = np.arange(len(state["tail"]), len(history)) + 1
        starts = np.maximum(ends - window, 0)
        means = (sums[ends] - sums[starts]) / (ends - starts)
        state["tail"] = history[max(0, len(history) - (window - 1)):] if window > 1 else np.zeros(0)
        return means


# ---------------------------------------------------------------------------
# Probes
# ---------------------------------------------------------------------------


@dataclass
class _Member:
    threshold: float
    aggregation: Aggregation | None


@dataclass(frozen=True)
class ProbeFiles:
    """What a probe was loaded from: its manifest JSON and its safetensors bytes
    (None for kinds without weights); the verdict log keeps them for replay."""

    manifest_json: str
    weights: bytes | None


@dataclass(eq=False)
class Probe:
    """A loaded probe: its manifest, its per-row forms and how forms become a score.

    The registry keeps the rest: requests bound to it, an unload waiting for them,
    and `retired` once a forced unload took it from requests still bound to it.
    """

    manifest: Manifest
    forms: list[Form]
    members: list[_Member]  # one per form; a cascade has several
    cascade_k: int = 0
    active_requests: int = 0
    unloading: bool = False
    retired: bool = False
    source: str = field(default="", compare=False)
    digest: str = ""  # files.probe_digest of what it was loaded from
    files: ProbeFiles | None = field(default=None, repr=False)

    @property
    def stateful(self) -> bool:
        """Its decisions depend on earlier rows of the request: a trajectory,
        min_tokens or patience. A replica that takes a request over mid-way
        would start them afresh."""
        return not self.stateless or self.manifest.min_tokens > 0 or self.manifest.patience > 1

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def stateless(self) -> bool:
        """Scores depend on the row alone, so all requests score in one call."""
        return all(m.aggregation is None for m in self.members)

    def new_state(self) -> list[dict | None] | None:
        """A binding's trajectory state; None for a stateless probe, which keeps none."""
        if self.stateless:
            return None
        return [m.aggregation.new_state() if m.aggregation else None for m in self.members]

    def score(self, values: np.ndarray, state: list[dict | None] | None) -> np.ndarray:
        """Scores of one request's rows (values: [rows, len(forms)], forward order);
        a stateless probe takes any rows and state None."""
        per_member = [
            m.aggregation.apply(values[:, j], state[j]) if m.aggregation else values[:, j]
            for j, m in enumerate(self.members)
        ]
        if not self.cascade_k:
            return np.asarray(per_member[0], dtype=np.float64)
        agree = np.zeros(values.shape[0], dtype=np.float64)
        for member, scores in zip(self.members, per_member):
            agree += scores >= member.threshold
        return agree


def build_probe(manifest: Manifest, tensors: dict[str, np.ndarray], source: str = "", digest: str = "") -> Probe:
    """Checks the weights against the manifest and folds them into forms."""
    used: set[str] = set()
    spec = manifest.scorer
    if spec.kind == "cascade":
        forms, members = [], []
        for member in spec.members:
            form, aggregation = _form_and_aggregation(member.scorer, tensors, manifest, used)
            forms.append(form)
            members.append(_Member(member.threshold, aggregation))
        k = spec.k
    else:
        form, aggregation = _form_and_aggregation(spec, tensors, manifest, used)
        forms, members, k = [form], [_Member(manifest.threshold, aggregation)], 0
    unused = sorted(set(tensors) - used)
    if unused:
        raise ManifestError(f"weights: tensor(s) {unused} are not used by a {manifest.kind} probe")
    return Probe(manifest, forms, members, cascade_k=k, source=source, digest=digest)


def _form_and_aggregation(
    spec: ScorerSpec, tensors: dict[str, np.ndarray], manifest: Manifest, used: set[str]
) -> tuple[Form, Aggregation | None]:
    if spec.kind == "trajectory":
        form, _ = _form_and_aggregation(spec.base, tensors, manifest, used)
        return form, Aggregation(spec.aggregation)
    hidden = manifest.hidden_size

    def vector(name: str, required: bool) -> np.ndarray | None:
        key = spec.prefix + name
        if key not in tensors:
            if required:
                raise ManifestError(f"weights: tensor {key!r} is missing for a {spec.kind} probe")
            return None
        used.add(key)
        value = np.asarray(tensors[key], dtype=np.float64)
        if value.shape not in ((hidden,), (1, hidden)):
            raise ManifestError(
                f"weights: tensor {key!r} has shape {list(value.shape)}, expected [{hidden}] "
                f"(manifest.hidden_size)"
            )
        if not np.isfinite(value).all():
            raise ManifestError(f"weights: tensor {key!r} has NaN or Inf values")
        return value.reshape(hidden)

    if spec.kind == "norm":
        center = vector("center", required=False)
        return NormForm(None if center is None else center.astype(np.float32)), None
    if spec.kind == "mean_difference":
        direction = vector("direction", required=True)
        length = np.linalg.norm(direction)
        if length == 0:
            raise ManifestError(f"weights: tensor {spec.prefix + 'direction'!r} is all zeros")
        unit = direction / length
        center = vector("center", required=False)
        bias = 0.0 if center is None else -float(center @ unit)
        return LinearForm(unit.astype(np.float32), bias, sigmoid=False), None
    weight = vector("weight", required=True)
    bias = _scalar(tensors, spec.prefix + "bias", used)
    mean, std = vector("mean", required=False), vector("std", required=False)
    if (mean is None) != (std is None):
        raise ManifestError(
            f"weights: standardisation needs both {spec.prefix + 'mean'!r} and {spec.prefix + 'std'!r}"
        )
    if std is not None:
        if (std <= 0).any():
            raise ManifestError(f"weights: tensor {spec.prefix + 'std'!r} has values <= 0")
        # ((x - mean) / std).w + b == x.(w / std) + (b - mean.(w / std))
        weight = weight / std
        bias -= float(mean @ weight)
    return LinearForm(weight.astype(np.float32), bias, sigmoid=spec.output == "sigmoid"), None


def _scalar(tensors: dict[str, np.ndarray], key: str, used: set[str]) -> float:
    if key not in tensors:
        return 0.0
    used.add(key)
    value = np.asarray(tensors[key], dtype=np.float64)
    if value.size != 1:
        raise ManifestError(f"weights: tensor {key!r} has shape {list(value.shape)}, expected [] or [1]")
    if not np.isfinite(value).all():
        raise ManifestError(f"weights: tensor {key!r} is NaN or Inf")
    return float(value.reshape(()))


# ---------------------------------------------------------------------------
# One matrix product per block for every probe that reads it
# ---------------------------------------------------------------------------


# Rows widened, checked and projected per slice of this many float32 bytes: a slice
# then stays in a core's cache between the three passes. 256 KiB measured best on a
# 2 MiB-L2 core for hidden sizes 1024-8192, 20-50% less CPU than one slice
# (`python -m bench.projection`).
SLICE_BYTES = 256 * 1024


class ProjectionPlan:
    """The forms of several probes stacked so one block costs one matrix product."""

    def __init__(self, probes: tuple[Probe, ...]):
        self.probes = probes
        self.columns: dict[int, slice] = {}  # id(probe) -> its columns in the output
        linear: list[LinearForm] = []
        self.norms: list[tuple[int, NormForm]] = []
        slots = []
        for probe in probes:
            start = len(slots)
            for form in probe.forms:
                if isinstance(form, LinearForm):
                    slots.append(("linear", len(linear)))
                    linear.append(form)
                else:
                    slots.append(("norm", len(self.norms)))
                    self.norms.append((len(slots) - 1, form))
            self.columns[id(probe)] = slice(start, len(slots))
        self.width = len(slots)
        self.first_columns = np.array([self.columns[id(p)].start for p in probes], dtype=np.int64)
        self.linear_columns = np.array([i for i, s in enumerate(slots) if s[0] == "linear"], dtype=np.int64)
        if linear:
            # [L, hidden], used transposed: BLAS runs a skinny x @ W.T several times
            # faster than x @ W with W stored [hidden, L].
            self.weight = np.stack([f.weight for f in linear])
            self.bias = np.array([f.bias for f in linear], dtype=np.float32)
            self.sigmoid = np.array([f.sigmoid for f in linear])
        self.has_linear = bool(linear)

    def apply(self, rows: np.ndarray) -> np.ndarray:
        """[n, hidden] float32 -> [n, width] float64 form values."""
        return self.evaluate([rows], "float32")[0]

    def evaluate(self, blocks: Sequence[np.ndarray], wire_dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """The form values of the blocks' rows end to end ([n, width] float64), and
        which of those rows are all finite.

        Rows come as they are stored on the wire (bfloat16 as its bits). Each
        SLICE_BYTES of them is widened into one scratch array, checked and projected
        while it is still in the core's cache, so a batch never exists as float32 in
        full; a row with NaN or Inf gets values here too, which the caller discards."""
        n = sum(block.shape[0] for block in blocks)
        hidden = blocks[0].shape[1] if blocks else 0
        finite = np.empty(n, dtype=bool)
        linear = np.empty((n, len(self.linear_columns)), dtype=np.float32)
        norms = np.empty((n, len(self.norms)), dtype=np.float64)
        step = max(1, SLICE_BYTES // (4 * max(hidden, 1)))
        scratch = np.empty((min(step, n), hidden), dtype=np.float32)
        start = 0
        with np.errstate(invalid="ignore", over="ignore"):  # only in rows flagged not finite
            for part in _slices(blocks, step):
                end = start + part.shape[0]
                rows = tensor_codec.to_float32(part, wire_dtype, out=scratch[: part.shape[0]])
                np.isfinite(rows).all(axis=1, out=finite[start:end])
                if self.has_linear:
                    np.matmul(rows, self.weight.T, out=linear[start:end])
                for j, (_, form) in enumerate(self.norms):
                    centred = rows if form.center is None else rows - form.center
                    norms[start:end, j] = np.sqrt(np.einsum("ij,ij->i", centred, centred, dtype=np.float64))
                start = end
            out = np.empty((n, self.width), dtype=np.float64)
            if self.has_linear:
                z = (linear + self.bias).astype(np.float64)
                if self.sigmoid.any():
                    z[:, self.sigmoid] = sigmoid(z[:, self.sigmoid])
                out[:, self.linear_columns] = z
        for j, (column, _) in enumerate(self.norms):
            out[:, column] = norms[:, j]
        return out, finite


def _slices(blocks: Sequence[np.ndarray], step: int) -> Iterator[np.ndarray]:
    """The blocks' rows end to end in slices of `step` rows (the last may be
    shorter): views of a block where a slice lies within one, else its pieces
    joined. A step's blocks are often a few rows each (one per request, one block
    per layer), so joining them keeps the numpy calls per slice, not per block."""
    pending: list[np.ndarray] = []
    count = 0
    for block in blocks:
        first = 0
        while first < block.shape[0]:
            take = min(step - count, block.shape[0] - first)
            pending.append(block[first:first + take])
            count += take
            first += take
            if count == step:
                yield pending[0] if len(pending) == 1 else np.concatenate(pending)
                pending, count = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else np.concatenate(pending)


# ---------------------------------------------------------------------------
# Decision rule
# ---------------------------------------------------------------------------


def first_firing_segments(
    scores: np.ndarray,
    starts: np.ndarray,
    threshold: np.ndarray,
    min_tokens: np.ndarray,
    patience: np.ndarray,
    seen: np.ndarray,
    streak: np.ndarray,
) -> np.ndarray:
    """The rule over many requests and probes at once: per segment and probe, the
    index of its first firing row, or -1.

    scores is [rows, probes]; threshold, min_tokens and patience are per probe
    ([probes]). Segments are back to back (starts ascending), each one request's
    rows in forward order. Row i fires for a probe when its score >= threshold, the
    last `patience` rows of its request (this one included, across batches) all
    were, and at least `min_tokens` rows were scored. seen and streak ([segments,
    probes]) carry each segment's state in, updated in place.
    """
    n = scores.shape[0]
    index = np.arange(n)[:, None]
    lengths = np.diff(np.append(starts, n))
    segment = np.repeat(np.arange(starts.size), lengths)
    segment_start = starts[segment][:, None]
    above = scores >= threshold
    # The last row below threshold, where a segment's start counts as one just before it.
    marks = np.where(above, -1, index)
    marks[starts] = np.maximum(marks[starts], (starts - 1)[:, None])
    last_below = np.maximum.accumulate(marks, axis=0)
    run = index - last_below
    run_rows = np.where(last_below < segment_start, run + streak[segment], run)
    seen_rows = seen[segment] + (index - segment_start + 1)
    fires = above & (run_rows >= patience) & (seen_rows >= min_tokens)
    first = np.minimum.reduceat(np.where(fires, index, n), starts, axis=0)
    seen += lengths[:, None]
    streak[:] = run_rows[starts + lengths - 1]
    return np.where(first < n, first, -1)
