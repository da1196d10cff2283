"""Probe math against references: scikit-learn for linear probes, plain-Python
loops for trajectories and rules. No gRPC here."""

import math

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from common import tensor_codec
from common.probe_format import probes as probes_module
from common.probe_format.manifest import manifest_from_dict
from common.probe_format.probes import ProjectionPlan, build_probe, first_firing_segments
from tests.router.helpers import manifest

H = 16


def probe(name="p", kind="logistic", tensors=None, **fields):
    return build_probe(manifest_from_dict(manifest(name, kind, hidden_size=H, **fields)), tensors or {})


def form_values(p, rows):
    plan = ProjectionPlan((p,))
    return plan.apply(rows.astype(np.float32))[:, plan.columns[id(p)]]


def split_points(rng, n):
    """Random batch boundaries, so state must carry across batches."""
    cuts = sorted(rng.choice(np.arange(1, n), size=4, replace=False))
    return [0, *cuts, n]


def score_in_batches(p, values, bounds):
    state = p.new_state()
    return np.concatenate([p.score(values[a:b], state) for a, b in zip(bounds, bounds[1:])])


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def fitted_logistic(rng, standardise):
    x = rng.normal(size=(400, H)) * rng.uniform(0.5, 3, H) + rng.normal(size=H)
    y = (x @ rng.normal(size=H) + rng.normal(size=400) > 0).astype(int)
    mean, std = x.mean(0), x.std(0)
    clf = LogisticRegression(max_iter=1000).fit((x - mean) / std if standardise else x, y)
    tensors = {"weight": clf.coef_[0], "bias": clf.intercept_}
    if standardise:
        tensors |= {"mean": mean, "std": std}
    return x, clf, tensors, mean, std


@pytest.mark.parametrize("standardise", [False, True])
def test_logistic_probe_matches_sklearn_predict_proba(rng, standardise):
    x, clf, tensors, mean, std = fitted_logistic(rng, standardise)
    p = probe(tensors=tensors)
    got = form_values(p, x)[:, 0]
    reference = clf.predict_proba((x - mean) / std if standardise else x)[:, 1]
    np.testing.assert_allclose(got, reference, rtol=2e-5, atol=2e-6)


def test_linear_probe_raw_output_matches_sklearn_decision_function(rng):
    x, clf, tensors, *_ = fitted_logistic(rng, standardise=False)
    p = probe(kind="linear", tensors=tensors, threshold=0.0)
    np.testing.assert_allclose(form_values(p, x)[:, 0], clf.decision_function(x), rtol=1e-4, atol=1e-4)


def test_mean_difference_projects_onto_the_unit_direction(rng):
    a, b = rng.normal(1, 1, (50, H)), rng.normal(-1, 1, (50, H))
    direction = a.mean(0) - b.mean(0)
    center = (a.mean(0) + b.mean(0)) / 2
    p = probe(kind="mean_difference", tensors={"direction": direction, "center": center}, threshold=0.0)
    x = rng.normal(size=(20, H))
    expected = [float(np.dot(row - center, direction) / math.sqrt(np.dot(direction, direction))) for row in x]
    np.testing.assert_allclose(form_values(p, x)[:, 0], expected, rtol=1e-5, atol=1e-5)


def test_norm_monitor_with_and_without_center(rng):
    x = rng.normal(size=(10, H))
    center = rng.normal(size=H)
    plain, centred = probe("n1", "norm", threshold=3.0), probe("n2", "norm", {"center": center}, threshold=3.0)
    np.testing.assert_allclose(form_values(plain, x)[:, 0], [math.sqrt(sum(v * v for v in r)) for r in x],
                               rtol=1e-5)
    np.testing.assert_allclose(form_values(centred, x)[:, 0], np.linalg.norm(x - center, axis=1), rtol=1e-5)


def test_one_plan_for_many_probes_equals_each_probe_alone(rng):
    probes = [probe(f"p{i}", tensors={"weight": rng.normal(size=H), "bias": rng.normal(size=1)})
              for i in range(5)] + [probe("n", "norm", threshold=1.0)]
    x = rng.normal(size=(30, H)).astype(np.float32)
    plan = ProjectionPlan(tuple(probes))
    together = plan.apply(x)
    for p in probes:
        np.testing.assert_allclose(together[:, plan.columns[id(p)]], form_values(p, x), rtol=1e-6)


@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float16", "float32"])
def test_evaluate_reads_wire_rows_slice_by_slice_as_one_array(rng, monkeypatch, wire_dtype):
    """Blocks as stored on the wire, cut into slices that straddle the blocks'
    boundaries, give the values and finiteness of their float32 rows end to end."""
    monkeypatch.setattr(probes_module, "SLICE_BYTES", 3 * H * 4)  # 3 rows per slice
    center = rng.normal(size=H)
    probes = (probe("lin", "linear", {"weight": rng.normal(size=H), "bias": rng.normal(size=1)}, threshold=0.0),
              probe("log", tensors={"weight": rng.normal(size=H), "bias": rng.normal(size=1)}),
              probe("n", "norm", {"center": center}, threshold=1.0))
    rows = [rng.normal(size=(n, H)).astype(np.float32) for n in (4, 1, 7)]
    rows[0][1, 3], rows[2][2, 0], rows[2][6, 15] = np.nan, np.inf, -np.inf
    stored = [tensor_codec.unpack(wire_dtype, r.shape, tensor_codec.pack(r, wire_dtype)[2], as_float32=False)
              for r in rows]
    widened = np.concatenate([tensor_codec.to_float32(r, wire_dtype) for r in stored]).astype(np.float64)
    plan = ProjectionPlan(probes)

    values, finite = plan.evaluate(stored, wire_dtype)

    assert values.shape == (12, 3)
    assert finite.tolist() == [i not in (1, 4 + 1 + 2, 11) for i in range(12)]
    lin, log = (widened @ p.forms[0].weight + p.forms[0].bias for p in probes[:2])
    expected = np.column_stack([lin, 1 / (1 + np.exp(-log)), np.linalg.norm(widened - center.astype(np.float32), axis=1)])
    np.testing.assert_allclose(values[finite], expected[finite], rtol=1e-5, atol=1e-6)
    empty_values, empty_finite = ProjectionPlan(()).evaluate(stored, wire_dtype)
    assert empty_values.shape == (12, 0) and empty_finite.tolist() == finite.tolist()


# -- trajectories: vectorised over batches vs plain loops ---------------------


def ema_loop(xs, alpha):
    out, y = [], None
    for x in xs:
        y = x if y is None else alpha * x + (1 - alpha) * y
        out.append(y)
    return out


def rolling_mean_loop(xs, window):
    return [sum(xs[max(0, i - window + 1) : i + 1]) / len(xs[max(0, i - window + 1) : i + 1])
            for i in range(len(xs))]


def max_rolling_mean_loop(xs, window):
    out, best = [], -math.inf
    for value in rolling_mean_loop(xs, window):
        best = max(best, value)
        out.append(best)
    return out


def count_over_loop(xs, over):
    out, count = [], 0
    for x in xs:
        count += x >= over
        out.append(count)
    return out


@pytest.mark.parametrize(
    "aggregation, reference",
    [
        ({"kind": "ema", "alpha": 0.3}, lambda xs: ema_loop(xs, 0.3)),
        ({"kind": "ema", "alpha": 1.0}, lambda xs: ema_loop(xs, 1.0)),
        ({"kind": "rolling_mean", "window": 5}, lambda xs: rolling_mean_loop(xs, 5)),
        ({"kind": "rolling_mean", "window": 1}, lambda xs: rolling_mean_loop(xs, 1)),
        ({"kind": "max_rolling_mean", "window": 4}, lambda xs: max_rolling_mean_loop(xs, 4)),
        ({"kind": "count_over", "over": 0.25}, lambda xs: count_over_loop(xs, 0.25)),
    ],
)
def test_trajectory_across_batches_matches_a_loop(rng, aggregation, reference):
    weight = rng.normal(size=H)
    p = probe(kind="trajectory", base={"kind": "linear"}, aggregation=aggregation,
              tensors={"weight": weight})
    x = rng.normal(size=(40, H))
    values = form_values(p, x)
    got = score_in_batches(p, values, split_points(rng, len(x)))
    expected = reference([float(v) for v in values[:, 0]])
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9)



@pytest.mark.parametrize("kind", ["rolling_mean", "max_rolling_mean"])
def test_a_window_longer_than_the_rows_so_far_carries_all_of_them(rng, kind):
    """Batches of one to three rows against a window of 5: the tail carried to
    the next batch is every row so far until there are window - 1 of them (a
    tail cut from a negative index kept too few, e.g. batches [1, 2] then [3]
    gave a mean of 2.5, not 2)."""
    p = probe(kind="trajectory", base={"kind": "linear"}, aggregation={"kind": kind, "window": 5},
              tensors={"weight": rng.normal(size=H)})
    values = form_values(p, rng.normal(size=(12, H)))
    for bounds in ([0, 2, 3, 12], [0, 1, 3, 6, 12], [0, 3, 4, 5, 12]):
        reference = (rolling_mean_loop if kind == "rolling_mean" else max_rolling_mean_loop)
        np.testing.assert_allclose(score_in_batches(p, values, bounds),
                                   reference([float(v) for v in values[:, 0]], 5), rtol=1e-9, atol=1e-9)


def test_cascade_counts_agreeing_members_with_their_own_trajectories(rng):
    w_a, w_b = rng.normal(size=H), rng.normal(size=H)
    fields = dict(k=2, members=[
        {"name": "a", "kind": "linear", "threshold": 0.0},
        {"name": "b", "kind": "trajectory", "threshold": 0.2, "base": {"kind": "linear"},
         "aggregation": {"kind": "ema", "alpha": 0.5}},
        {"name": "c", "kind": "norm", "threshold": 4.0},
    ])
    spec = manifest("casc", "cascade", hidden_size=H, **fields)
    del spec["threshold"]
    p = build_probe(manifest_from_dict(spec), {"a.weight": w_a, "b.weight": w_b})
    assert p.manifest.threshold == 2.0
    x = rng.normal(size=(30, H))
    got = score_in_batches(p, form_values(p, x), split_points(rng, len(x)))
    a = [float(r @ w_a) >= 0.0 for r in x]
    b = [v >= 0.2 for v in ema_loop([float(r @ w_b) for r in x], 0.5)]
    c = [float(np.sqrt(r @ r)) >= 4.0 for r in x]
    np.testing.assert_array_equal(got, [int(i) + int(j) + int(k) for i, j, k in zip(a, b, c)])


# -- the decision rule ---------------------------------------------------------


def first_firing_loop(scores, threshold, min_tokens, patience):
    streak = 0
    for i, s in enumerate(scores):
        streak = streak + 1 if s >= threshold else 0
        if s >= threshold and streak >= patience and i + 1 >= min_tokens:
            return i
    return None


@pytest.mark.parametrize("seed", range(20))
def test_rule_across_batches_matches_a_loop(seed):
    """One request, its rows split over batches: the state carries the streak and count."""
    rng = np.random.default_rng(seed)
    scores = rng.uniform(size=30)
    threshold, min_tokens, patience = 0.4, int(rng.integers(0, 12)), int(rng.integers(1, 4))
    seen, streak, got = np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64), None
    bounds = split_points(rng, len(scores))
    for a, b in zip(bounds, bounds[1:]):
        hit = first_firing_segments(scores[a:b, None], np.array([0]), np.array([threshold]),
                                    np.array([min_tokens]), np.array([patience]), seen, streak)
        if hit[0, 0] >= 0 and got is None:
            got = a + int(hit[0, 0])
    assert got == first_firing_loop(scores, threshold, min_tokens, patience)


def test_rule_over_many_requests_and_probes_at_once_matches_a_loop_per_request_and_probe():
    """Each probe (column) keeps its own threshold, min_tokens, patience and state."""
    rng = np.random.default_rng(99)
    lengths = rng.integers(1, 9, size=40)
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    rules = [(0.5, 4, 3), (0.3, 0, 1), (0.7, 9, 2)]  # threshold, min_tokens, patience per probe
    scores = rng.uniform(size=(lengths.sum(), len(rules)))
    carried_seen, carried_streak = rng.integers(0, 5, size=(40, 3)), rng.integers(0, 3, size=(40, 3))
    seen, streak = carried_seen.copy(), carried_streak.copy()
    threshold, min_tokens, patience = (np.array(column) for column in zip(*rules))
    hits = first_firing_segments(scores, starts, threshold, min_tokens, patience, seen, streak)
    assert hits.shape == (40, 3)
    for j, (cut, least, needed) in enumerate(rules):
        for k, (a, n) in enumerate(zip(starts, lengths)):
            run, hit = int(carried_streak[k, j]), None
            for i, s in enumerate(scores[a : a + n, j]):
                run = run + 1 if s >= cut else 0
                if hit is None and s >= cut and run >= needed and carried_seen[k, j] + i + 1 >= least:
                    hit = i
            assert hits[k, j] == (-1 if hit is None else a + hit)
            assert (seen[k, j], streak[k, j]) == (carried_seen[k, j] + n, run)
