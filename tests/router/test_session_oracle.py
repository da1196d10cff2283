"""SessionState against an oracle: random probes, requests and steps, fed batch by
batch, compared with what a plain computation per request and probe over the whole
run says the session must send.

The session scores every request of a batch at once, groups the probes that read
the same rows, and carries trajectories and rule streaks from batch to batch. The
oracle does none of that: it takes each (request, probe)'s rows in forward order,
writes the probe math out plainly and runs the rule as a loop over the whole run,
so a slip in grouping, ordering, carried state or the choice between aborts shows
up as a difference. Free constants (thresholds, count_over's `over`) sit in wide
gaps between the values they are compared with, so the session's float32 matrix
product never flips a comparison the float64 oracle makes.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from common import tensor_codec
from common.activations import Block, to_batch
from router_service.metrics import RouterMetrics
from common.probe_format.files import load_probe_path, write_probe
from router_service.registry import ProbeRegistry
from router_service.session import SessionState
from tests.router.helpers import model_info
from tests.router.test_probe_math import (
    count_over_loop,
    ema_loop,
    first_firing_loop,
    max_rolling_mean_loop,
    rolling_mean_loop,
)
from undercurrent.v1 import router_session_pb2 as session_pb
from undercurrent.v1 import types_pb2 as types_pb

HIDDEN = 16
LAYERS = 3
TENSOR_TYPES = {"residual_stream": types_pb.TENSOR_TYPE_RESIDUAL_STREAM, "mlp_out": types_pb.TENSOR_TYPE_MLP_OUT,
                "final_norm": types_pb.TENSOR_TYPE_FINAL_NORM}
# What the engine captures every step; final_norm rows carry layer index num_layers.
CAPTURED = [(t, layer) for t in ("residual_stream", "mlp_out") for layer in range(LAYERS)] + [
    ("final_norm", LAYERS)]
SELECTORS = [
    {"scope": "generated"},
    {"scope": "all"},
    {"scope": "prompt", "indexes": [-1]},
    {"scope": "all", "ranges": [{"start": 2, "stop": 7}]},
    {"scope": "generated", "indexes": [0, 2]},
]
TOKEN_KINDS = ["linear", "logistic", "mean_difference", "norm"]
AGGREGATIONS = {
    "ema": lambda xs, spec: ema_loop(xs, spec["alpha"]),
    "rolling_mean": lambda xs, spec: rolling_mean_loop(xs, spec["window"]),
    "max_rolling_mean": lambda xs, spec: max_rolling_mean_loop(xs, spec["window"]),
    "count_over": lambda xs, spec: count_over_loop(xs, spec["over"]),
}
SHAPES = [*TOKEN_KINDS, *AGGREGATIONS, "cascade"]  # every scenario has one probe of each
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def f32(values) -> np.ndarray:
    """Weights as the float32 probe file stores them, so the oracle reads the same numbers."""
    return np.asarray(values, dtype=np.float32)


@dataclass
class Scorer:
    """A token kind, maybe under an aggregation: a probe, or one member of a cascade."""

    kind: str  # one of TOKEN_KINDS
    tensors: dict[str, np.ndarray]
    output: str = "raw"  # linear and logistic
    aggregation: dict | None = None
    threshold: float = 0.0  # as a cascade member

    def token_values(self, rows: np.ndarray) -> np.ndarray:
        t = self.tensors
        if self.kind == "norm":
            return np.sqrt(((rows - t.get("center", 0.0)) ** 2).sum(axis=1))
        if self.kind == "mean_difference":
            direction = t["direction"].astype(np.float64)
            return (rows - t.get("center", 0.0)) @ (direction / np.sqrt(direction @ direction))
        standardised = (rows - t["mean"]) / t["std"] if "mean" in t else rows
        z = standardised @ t["weight"] + t["bias"][0]
        return 1 / (1 + np.exp(-z)) if self.output == "sigmoid" else z

    def scores(self, rows: np.ndarray) -> list[float]:
        """One request's scores, its rows in forward order."""
        values = [float(v) for v in self.token_values(rows)]
        return AGGREGATIONS[self.aggregation["kind"]](values, self.aggregation) if self.aggregation else values

    def fields(self) -> dict:
        base = {"kind": self.kind} | ({"output": self.output} if self.kind in ("linear", "logistic") else {})
        return {"kind": "trajectory", "base": base, "aggregation": self.aggregation} if self.aggregation else base


@dataclass
class ProbeSpec:
    """A probe as written to disk (manifest and weights) and as the oracle scores it."""

    name: str
    tensor_type: str
    layers: tuple[int, ...]  # the layers its rows carry
    tokens: dict
    scorers: list[Scorer]  # one, or a cascade's members
    k: int  # a cascade's members that must agree; 0: not a cascade
    action: str
    min_tokens: int
    patience: int
    threshold: float = 0.0
    # The probe this one copies, scorers and rule, under another name and action: the
    # two fire on the same rows, so only the binding order tells their aborts apart.
    twin: ProbeSpec | None = None

    def scores(self, rows: np.ndarray) -> list[float]:
        if not self.k:
            return self.scorers[0].scores(rows)
        agreeing = [np.array(s.scores(rows)) >= s.threshold for s in self.scorers]
        return [float(v) for v in np.sum(agreeing, axis=0)]

    def write(self, directory) -> None:
        manifest = {"name": self.name, "version": "1", "tensor_type": self.tensor_type, "hidden_size": HIDDEN,
                    "dtype": "float32", "action": self.action, "tokens": self.tokens,
                    "rule": {"min_tokens": self.min_tokens, "patience": self.patience}}
        if self.tensor_type != "final_norm":
            manifest["layers"] = list(self.layers)
        if self.k:
            manifest |= {"kind": "cascade", "k": self.k, "members": [
                {"name": f"m{i}", "threshold": s.threshold} | s.fields() for i, s in enumerate(self.scorers)]}
            tensors = {f"m{i}.{key}": v for i, s in enumerate(self.scorers) for key, v in s.tensors.items()}
        else:
            manifest |= {"threshold": self.threshold} | self.scorers[0].fields()
            tensors = self.scorers[0].tensors
        write_probe(directory / self.name, manifest, tensors)


@dataclass
class Request:
    """One request's plan and the rows the engine captured for it."""

    request_id: str
    incarnation: int
    prompt_tokens: int
    bindings: list[tuple[ProbeSpec, int]]  # request_start order; action UNSPECIFIED defers to the manifest
    start: int  # request_start goes right before this step
    end: int  # request_end goes right before this step (the step count: after the last one)
    positions: dict[int, list[int]] = field(default_factory=dict)  # step -> the positions it carries
    rows: dict[tuple[str, int, int], np.ndarray] = field(default_factory=dict)  # (type, layer, position)

    def read(self, probe: ProbeSpec) -> tuple[list[tuple[int, int]], np.ndarray]:
        """The (position, layer) of each row `probe` reads of this request over the
        whole run, in forward order, and those rows."""
        keys = sorted((position, layer) for positions in self.positions.values() for position in positions
                      if selects(probe.tokens, position, self.prompt_tokens) for layer in probe.layers)
        rows = [self.rows[(probe.tensor_type, layer, position)] for position, layer in keys]
        return keys, np.array(rows, dtype=np.float64).reshape(len(keys), HIDDEN)


def binding_aborts(probe: ProbeSpec, action: int) -> bool:
    """A binding's action, or the manifest's when the binding leaves it unspecified."""
    return action == types_pb.PROBE_ACTION_ABORT or (action == types_pb.PROBE_ACTION_UNSPECIFIED and probe.action == "abort")


def selects(tokens: dict, position: int, prompt_tokens: int) -> bool:
    """A manifest's token selector read literally: scope, then indexes or ranges within it."""
    scope = tokens["scope"]
    local = position - prompt_tokens if scope == "generated" else position
    in_scope = {"prompt": position < prompt_tokens, "generated": position >= prompt_tokens}.get(scope, True)

    def resolve(index: int) -> int:  # negative prompt indexes count from the prompt's end
        return prompt_tokens + index if scope == "prompt" and index < 0 else index

    picked = [local == resolve(i) for i in tokens.get("indexes", [])]
    picked += [resolve(r["start"]) <= local < resolve(r["stop"]) for r in tokens.get("ranges", [])]
    return in_scope and (any(picked) or not picked)


def gap_threshold(values: list[float], rng: np.random.Generator) -> float:
    """A threshold at a random quantile of the values, mid-way across the widest of
    the few gaps there, so no value lies within rounding error of it."""
    ordered = np.unique(values)
    if ordered.size < 2:
        return float(ordered[0]) + 0.5 if ordered.size else 0.0
    gaps = np.diff(ordered)
    low = int(rng.integers(0, gaps.size))
    i = low + int(np.argmax(gaps[low:low + 4]))
    return float(ordered[i] + ordered[i + 1]) / 2


def random_scorer(rng: np.random.Generator, shape: str) -> Scorer:
    """A scorer of a token kind, or of an aggregation over a random token kind."""
    if shape in AGGREGATIONS:
        scorer = random_scorer(rng, str(rng.choice(TOKEN_KINDS)))
        if shape == "ema":
            scorer.aggregation = {"kind": shape, "alpha": round(float(rng.uniform(0.2, 1.0)), 3)}
        elif shape == "count_over":
            scorer.aggregation = {"kind": shape, "over": 0.0}  # calibrate() sets it
        else:
            # Windows longer than a request's first batches: the tail carried between
            # batches is then the whole history so far.
            scorer.aggregation = {"kind": shape, "window": int(rng.integers(1, 7))}
        return scorer
    center = {"center": f32(rng.normal(size=HIDDEN) / 2)} if rng.random() < 0.5 else {}
    if shape == "norm":
        return Scorer("norm", center)
    if shape == "mean_difference":
        return Scorer("mean_difference", {"direction": f32(rng.normal(size=HIDDEN))} | center)
    tensors = {"weight": f32(rng.normal(size=HIDDEN) / 4), "bias": f32([rng.normal()])}
    if rng.random() < 0.3:
        tensors |= {"mean": f32(rng.normal(size=HIDDEN) / 2), "std": f32(rng.uniform(0.5, 2.0, HIDDEN))}
    output = "sigmoid" if shape == "logistic" else str(rng.choice(["raw", "sigmoid"]))
    return Scorer(shape, tensors, output)


def random_probes(rng: np.random.Generator) -> list[ProbeSpec]:
    """Probes in families that read the same rows under the same selector, which the
    session scores as one group; some families read several layers."""
    families = []
    for _ in range(int(rng.integers(3, 6))):
        tensor_type = str(rng.choice(list(TENSOR_TYPES), p=[0.45, 0.35, 0.2]))
        layers = (LAYERS,) if tensor_type == "final_norm" else tuple(
            sorted(int(x) for x in rng.choice(LAYERS, size=int(rng.integers(1, LAYERS + 1)), replace=False)))
        families.append((tensor_type, layers, SELECTORS[int(rng.integers(len(SELECTORS)))]))
    shapes = SHAPES + [str(s) for s in rng.choice(SHAPES, size=int(rng.integers(0, 8)))]
    probes = []
    for i, shape in enumerate(shapes):
        tensor_type, layers, tokens = families[int(rng.integers(len(families)))]
        members = int(rng.integers(2, 4)) if shape == "cascade" else 1
        scorers = [random_scorer(rng, str(rng.choice(SHAPES[:-1])) if shape == "cascade" else shape)
                   for _ in range(members)]
        probes.append(ProbeSpec(f"p{i:02d}-{shape}", tensor_type, layers, tokens, scorers,
                                k=int(rng.integers(1, members + 1)) if shape == "cascade" else 0,
                                action=str(rng.choice(["observe", "abort"])),
                                min_tokens=int(rng.integers(0, 5)), patience=int(rng.integers(1, 4))))
    for original in rng.choice(probes, size=int(rng.integers(1, 3)), replace=False):
        probes.append(replace(original, name=f"{original.name}-twin", twin=original,
                              action=str(rng.choice(["observe", "abort"]))))
    return probes


def random_requests(rng: np.random.Generator, probes: list[ProbeSpec], steps: int) -> list[Request]:
    """Requests that start and end at random steps (an ended one's id is sometimes
    reused with the next incarnation), binding whole families, parts or nothing,
    and carrying rows at random steps: first many prompt positions, then one or two."""
    families = defaultdict(list)
    for probe in probes:
        families[(probe.tensor_type, probe.layers, str(probe.tokens))].append(probe)
    requests: list[Request] = []
    for i in range(int(rng.integers(6, 16))):
        start = 0 if rng.random() < 0.6 else int(rng.integers(1, steps))
        end = steps if rng.random() < 0.7 else int(rng.integers(start + 1, steps + 1))
        ended = [r for r in requests if r.end <= start and not any(
            o.request_id == r.request_id and o.incarnation > r.incarnation for o in requests)]
        reuse = ended[int(rng.integers(len(ended)))] if ended and rng.random() < 0.5 else None
        bound = []
        for family in families.values():
            if (pick := rng.random()) < 0.4:
                bound += family
            elif pick < 0.6:
                bound += [p for p in family if rng.random() < 0.5]
        bound = [bound[j] for j in rng.permutation(len(bound))] if rng.random() < 0.9 else []
        actions = rng.choice([types_pb.PROBE_ACTION_UNSPECIFIED, types_pb.PROBE_ACTION_OBSERVE, types_pb.PROBE_ACTION_ABORT],
                             size=len(bound), p=[0.5, 0.25, 0.25])
        requests.append(Request(reuse.request_id if reuse else f"r{i}", reuse.incarnation + 1 if reuse else 1,
                                int(rng.integers(1, 9)), list(zip(bound, map(int, actions))), start, end))
    carried: list[Request] = []
    for step in range(steps):
        alive = [r for r in requests if r.start <= step < r.end]
        if rng.random() < 0.3:  # the same requests as the last step: the session's slot table is reused
            carried = [r for r in carried if r in alive]
        else:
            carried = [r for r in alive if rng.random() < 0.75]
        for request in carried:
            first = max((p[-1] + 1 for p in request.positions.values()), default=0)
            count = int(rng.integers(1, request.prompt_tokens + 2 if first == 0 else 3))
            request.positions[step] = list(range(first, first + count))
            for position in request.positions[step]:
                for tensor_type, layer in CAPTURED:
                    bits = tensor_codec.float32_to_bfloat16_bits(rng.normal(size=HIDDEN))
                    request.rows[(tensor_type, layer, position)] = tensor_codec.bfloat16_bits_to_float32(bits)
    return requests


def calibrate(probe: ProbeSpec, rows_per_request: list[np.ndarray], rng: np.random.Generator) -> None:
    """Sets count_over's `over`, members' thresholds and the rule's threshold in gaps
    of what they are compared with, over every request's rows (bound or not)."""
    if probe.twin:  # its scorers are its twin's, calibrated already
        probe.threshold = probe.twin.threshold
        return
    for scorer in probe.scorers:
        if scorer.aggregation and scorer.aggregation["kind"] == "count_over":
            scorer.aggregation["over"] = gap_threshold(
                [float(v) for rows in rows_per_request for v in scorer.token_values(rows)], rng)
        if probe.k:
            scorer.threshold = gap_threshold([v for rows in rows_per_request for v in scorer.scores(rows)], rng)
    probe.threshold = float(probe.k) if probe.k else gap_threshold(
        [v for rows in rows_per_request for v in probe.scores(rows)], rng)


def batch_of(requests: list[Request], step: int, rng: np.random.Generator) -> types_pb.ActivationBatch:
    """The step's rows as an engine sends them: a block per captured (tensor type,
    layer), in bfloat16 or float32, blocks and the rows inside each in random order."""
    keys = [(r, p) for r in requests for p in r.positions.get(step, [])]
    wire_dtype = str(rng.choice(["bfloat16", "float32"]))
    blocks = []
    for tensor_type, layer in [CAPTURED[i] for i in rng.permutation(len(CAPTURED))] if keys else []:
        picked = [keys[i] for i in rng.permutation(len(keys))]
        blocks.append(Block(tensor_type, TENSOR_TYPES[tensor_type], layer,
                            np.array([r.rows[(tensor_type, layer, p)] for r, p in picked]),
                            [r.request_id for r, _ in picked], np.array([p for _, p in picked]),
                            np.array([p >= r.prompt_tokens for r, p in picked]), wire_dtype))
    batch = to_batch(blocks, step=100 + step)
    # The id table in the requests' order, as an engine keeps it from step to step
    # (to_batch lists ids as the shuffled rows name them): the session then reuses
    # its slot table when the same requests come again.
    ids = [r.request_id for r in requests if step in r.positions]
    index = [ids.index(rid) for rid in batch.request_ids]
    for block in batch.blocks:
        block.request_index[:] = [index[i] for i in block.request_index]
    batch.request_ids[:] = ids
    return batch


def run_session(probes: list[ProbeSpec], requests: list[Request], steps: int, directory: Path,
                rng: np.random.Generator) -> tuple[list[session_pb.SessionResponse], RouterMetrics]:
    """Every reply of a session fed the scenario; checks each batch's replies are
    scores, then aborts, then its one ack."""
    registry = ProbeRegistry()
    for probe in probes:
        probe.write(directory)
        registry.load(load_probe_path(directory / probe.name))
    metrics = RouterMetrics()
    state = SessionState(registry, model_info(HIDDEN, LAYERS, TENSOR_TYPES.values()), metrics)
    digests = {p.name: p.digest for p in registry.probes()}
    replies = []
    for step in range(steps + 1):
        for r in requests:
            if r.end == step:
                assert state.end(session_pb.RequestEnd(request_id=r.request_id, incarnation=r.incarnation)) == []
        for r in requests:
            if r.start == step:
                assert state.start(session_pb.RequestStart(
                    request_id=r.request_id, incarnation=r.incarnation, prompt_tokens=r.prompt_tokens,
                    bindings=[session_pb.SessionBinding(probe=p.name, action=a, digest=digests[p.name])
                              for p, a in r.bindings])) == []
        if step < steps:
            out = state.batch(batch_of(requests, step, rng))
            kinds = [m.WhichOneof("message") for m in out]
            assert kinds == ["scores"] * kinds.count("scores") + ["abort"] * kinds.count("abort") + ["ack"]
            assert out[-1].ack.step == 100 + step
            replies += out[:-1]
    return replies, metrics


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_session_sends_what_a_per_request_oracle_computes(tmp_path_factory, seed):
    rng = np.random.default_rng(seed)
    steps = int(rng.integers(5, 11))
    probes = random_probes(rng)
    requests = random_requests(rng, probes, steps)
    for probe in probes:
        calibrate(probe, [r.read(probe)[1] for r in requests], rng)

    expected_scores, expected_aborts, rows_scored = {}, {}, Counter()
    for r in requests:
        fired = []
        for order, (probe, action) in enumerate(r.bindings):
            keys, rows = r.read(probe)
            scores = probe.scores(rows)
            rows_scored[probe.name] += len(scores)
            if not binding_aborts(probe, action):
                if scores:
                    expected_scores[(r.request_id, r.incarnation, probe.name)] = ([p for p, _ in keys], scores)
            elif (hit := first_firing_loop(scores, probe.threshold, probe.min_tokens, probe.patience)) is not None:
                fired.append((*keys[hit], order, probe.name, scores[hit]))  # earliest row, then binding order
        if fired:
            position, _, _, name, score = min(fired)
            expected_aborts[(r.request_id, r.incarnation)] = (name, position, score)

    replies, metrics = run_session(probes, requests, steps, tmp_path_factory.mktemp("probes"), rng)

    got_scores = defaultdict(lambda: ([], []))
    got_aborts = defaultdict(list)
    for m in replies:
        if m.WhichOneof("message") == "scores":
            sent = m.scores.probe_scores
            positions, scores = got_scores[(sent.request_id, m.scores.incarnation, sent.probe)]
            positions += sent.token_positions
            scores += sent.scores
        else:
            got_aborts[(m.abort.verdict.request_id, m.abort.incarnation)].append(
                (m.abort.verdict.probe, m.abort.verdict.token_position, m.abort.verdict.score))
    assert got_scores.keys() == expected_scores.keys()
    for key, (positions, scores) in expected_scores.items():
        assert got_scores[key][0] == positions, key
        np.testing.assert_allclose(got_scores[key][1], scores, **TOLERANCE, err_msg=str(key))
    assert got_aborts.keys() == expected_aborts.keys()
    for key, (name, position, score) in expected_aborts.items():
        assert [(n, p) for n, p, _ in got_aborts[key]] == [(name, position)], key  # one abort only
        np.testing.assert_allclose(got_aborts[key][0][2], score, **TOLERANCE)

    sample = metrics.registry.get_sample_value
    aborts_per_probe = Counter(name for name, _, _ in expected_aborts.values())
    for probe in probes:
        label = {"probe": probe.name}
        assert (sample("undercurrent_router_probe_rows_total", label) or 0) == rows_scored[probe.name]
        assert (sample("undercurrent_router_aborts_total", label) or 0) == aborts_per_probe[probe.name]
        if rows_scored[probe.name]:
            assert sample("undercurrent_router_probe_seconds_count", label) > 0
