"""The rollout rules, the verdict log's store and replay, and the audit command,
without gRPC."""

from __future__ import annotations

import io
import json
import sqlite3
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from common.canary import canary_point, canary_takes
from common.errors import FailedPrecondition
from common.probe_format.files import encode_safetensors, load_probe_bytes
from common.probe_format.manifest import manifest_from_dict
from common.probe_format.probes import ProjectionPlan
from router_service import rollout
from router_service.registry import Bound, ProbeRegistry
from undercurrent_client import audit
from common.verdict_log.records import ProbeVersion, ShadowOutcome, VerdictRecord
from common.verdict_log.replay import ReplayError, replay
from common.verdict_log.store import Query, StoreError, open_store
from router_service.verdict_log import LogMetrics, LogSettings, VerdictLog
from tests.router.helpers import HIDDEN, manifest
from undercurrent_client import cli


def test_canary_selection_is_a_stable_hash_nested_by_share():
    ids = [f"request-{i}" for i in range(4000)]
    points = [canary_point(rid) for rid in ids]
    assert points == [canary_point(rid) for rid in ids]  # the same on every call and replica
    assert canary_point("request-0") == pytest.approx(0.12647, abs=1e-5)  # fixed by the hash, not the run
    taken = {share: {rid for rid in ids if canary_takes(rid, share)} for share in (0.1, 0.25, 1.0)}
    assert taken[0.1] < taken[0.25] < taken[1.0] == set(ids)  # a larger share keeps the requests it had
    assert abs(len(taken[0.25]) / len(ids) - 0.25) < 0.03


@pytest.mark.parametrize("role, share, problem", [
    (rollout.CANARY, 0.0, "canary_share: 0 is not in (0, 1]"),
    (rollout.CANARY, 1.01, "canary_share: 1.01 is not in (0, 1]"),
    (rollout.SHADOW, 0.5, "canary_share: 0.5 is set, but the probe is not loaded as a canary"),
    (rollout.CANARY, 1.0, None), (rollout.SHADOW, 0.0, None), (rollout.SERVING, 0.0, None),
])
def test_share_fits_the_role(role, share, problem):
    reason = rollout.check_share(role, share)
    assert (reason is None) if problem is None else reason.startswith(problem)


def test_a_candidate_reads_the_serving_versions_rows():
    serving = manifest_from_dict(manifest("p", layers=[1, 2]))
    assert rollout.reads_differ(serving, manifest_from_dict(manifest("p", layers=[2, 1], threshold=0.1))) is None
    for field, value in (("layers", [1]), ("tensor_type", "mlp_out"), ("tokens", {"scope": "prompt"})):
        reason = rollout.reads_differ(serving, manifest_from_dict({**manifest("p", layers=[1, 2]), field: value}))
        assert reason.startswith(f"manifest.{field}: the candidate reads"), reason


def test_paired_deltas_match_rows_by_position_and_layer():
    serving = (np.array([5, 5, 6]), np.array([1, 2, 1]), np.array([0.1, 0.2, 0.3]))
    shadow = (np.array([5, 6, 7]), np.array([2, 1, 1]), np.array([0.5, 0.35, 0.9]))
    assert rollout.paired_deltas(serving, shadow) == pytest.approx([0.3, 0.05])


def test_agreement_counts_outcomes_and_buckets_deltas():
    agreement = rollout.Agreement()
    for serving, shadow in [(False, True), (False, True), (True, True), (False, False)]:
        agreement.outcome("p", "2", rollout.Outcome(serving, shadow))
    agreement.deltas("p", "2", np.array([0.0, -0.002, 0.3, 5.0]))
    assert agreement.outcomes() == {("p", "2", False, True): 2, ("p", "2", True, True): 1, ("p", "2", False, False): 1}
    counts = agreement.histograms()[("p", "2")]
    bounds = list(rollout.DELTA_BUCKETS) + [float("inf")]
    assert {bounds[i]: int(c) for i, c in enumerate(counts) if c} == {-0.001: 1, 0.0: 1, 0.5: 1, float("inf"): 1}


def test_a_request_binds_the_version_its_engine_pinned():
    """Engines see a canary beside its serving version and pin one of the two; a
    shadow they never see: it is bound beside the serving version. A version the
    router no longer holds for new requests is refused, never swapped."""
    (_, serving), (_, canary), (_, shadow) = (probe_version(threshold=t) for t in (0.5, 0.6, 0.7))
    registry = ProbeRegistry()
    registry.load(serving)
    registry.load(canary, role=rollout.CANARY, share=0.25)
    listed = registry.catalog_info(serving)
    assert (listed.digest, listed.role, listed.canary.digest, listed.canary.role, listed.canary.canary_share) == (
        serving.digest, rollout.SERVING, canary.digest, rollout.CANARY, 0.25)
    assert registry.bind("p", canary.digest) == Bound(canary, rollout.CANARY)
    assert registry.bind("p", serving.digest) == Bound(serving, rollout.SERVING)
    assert (canary.active_requests, serving.active_requests) == (1, 1)
    registry.roll_back("p")
    assert not registry.catalog_info(serving).HasField("canary")
    with pytest.raises(FailedPrecondition, match=f"the request was bound to {canary.digest}"):
        registry.bind("p", canary.digest)
    registry.load(shadow, role=rollout.SHADOW)
    assert not registry.catalog_info(serving).HasField("canary")
    assert registry.bind("p", serving.digest) == Bound(serving, rollout.SERVING, shadow=shadow)
    with pytest.raises(FailedPrecondition, match=f"the request was bound to {shadow.digest}"):
        registry.bind("p", shadow.digest)


def probe_version(threshold=0.5, kind="logistic", **fields) -> tuple[ProbeVersion, object]:
    text = json.dumps(manifest("p", kind=kind, threshold=threshold, **fields))
    weight = np.linspace(-1, 1, HIDDEN, dtype=np.float32)
    tensors = {"weight": weight, "bias": np.array([0.25])}
    if kind == "trajectory":
        tensors = {"weight": weight}
    weights = encode_safetensors(tensors, "float32")
    probe = load_probe_bytes(text, weights)
    return ProbeVersion.of(probe), probe


def abort_record(version: ProbeVersion, probe, scored: np.ndarray, **fields) -> VerdictRecord:
    """An abort whose score is the probe's on the last of the `scored` rows (kept as its rows)."""
    rows = scored
    score = float(probe.score(ProjectionPlan((probe,)).apply(rows), None)[-1])
    base = dict(kind="abort", request_id="r#1", caller="alice", probe="p", version="1", digest=version.digest,
                role="serving", layer=1, token_position=9, score=score, threshold=0.5, router="router-a",
                time=1_000.0, rows=rows, row_positions=[9] * len(rows), row_layers=list(range(len(rows))),
                probe_version=version)
    base.update(fields)
    if len(rows) > 1:
        base["row_layers"] = [0, 1][: len(rows)]
    return VerdictRecord(**base)


def test_the_store_keeps_records_versions_and_outcomes(tmp_path):
    version, probe = probe_version()
    rows = np.random.default_rng(1).normal(size=(2, HIDDEN)).astype(np.float32)
    target = str(tmp_path / "deep" / "log.db")
    store = open_store(target)
    records = [abort_record(version, probe, rows),
               abort_record(version, probe, rows[:1], kind="verdict", request_id="r#2", caller="bob", time=2_000.0,
                            rows=None, row_positions=[], row_layers=[])]
    store.write(records, [version])
    store.write([], [version], [ShadowOutcome(1_500.0, "r#1", "alice", "p", "1", "2", False, True, "router-a",
                                              3, 0.3, 0.2)])
    store.close()
    store = open_store(target, create=False)
    got = store.records(Query())
    assert [(r.id, r.kind, r.request_id, r.caller) for r in got] == [(1, "abort", "r#1", "alice"),
                                                                     (2, "verdict", "r#2", "bob")]
    assert np.array_equal(got[0].rows, rows) and got[0].row_layers == [0, 1] and got[1].rows is None
    assert [r.id for r in store.records(Query(since=1_500.0))] == [2]
    assert [r.id for r in store.records(Query(until=1_500.0, caller="alice", kind="abort", probe="p"))] == [1]
    assert store.records(Query(caller="carol")) == []
    assert store.probe_version(version.digest) == version
    assert [o.shadow_fired for o in store.outcomes(Query(probe="p"))] == [True]
    store.close()
    with pytest.raises(StoreError, match="no such file"):
        open_store(str(tmp_path / "missing.db"), create=False)


def test_replay_reproduces_the_score_and_refuses_what_it_cannot(tmp_path):
    version, probe = probe_version()
    rows = np.random.default_rng(2).normal(size=(1, HIDDEN)).astype(np.float32)
    record = abort_record(version, probe, rows, row_layers=[1])
    result = replay(record, version)
    assert result.matches and result.score == pytest.approx(record.score, abs=1e-6)
    assert not replay(abort_record(version, probe, rows, row_layers=[1], score=record.score + 0.01), version).matches
    with pytest.raises(ReplayError, match="keeps no input rows"):
        replay(abort_record(version, probe, rows, rows=None), version)
    with pytest.raises(ReplayError, match="is not in the log"):
        replay(record, None)
    with pytest.raises(ReplayError, match="not the record's"):
        replay(abort_record(version, probe, rows, row_layers=[1], digest="sha256:other"), version)
    with pytest.raises(ReplayError, match=r"do not include the trigger row \(token 9, layer 1\)"):
        replay(abort_record(version, probe, rows, row_layers=[3]), version)
    trajectory, _ = probe_version(kind="trajectory", base={"kind": "linear"}, aggregation={"kind": "ema", "alpha": 0.5})
    with pytest.raises(ReplayError, match="earlier rows too"):
        replay(abort_record(version, probe, rows, row_layers=[1], digest=trajectory.digest), trajectory)


def test_audit_commands_name_bad_input(tmp_path, monkeypatch):
    monkeypatch.delenv(audit.LOG_ENV, raising=False)
    for args, message in [
        (["list"], "audit list: --log PATH|URL is required (or set $UNDERCURRENT_VERDICT_LOG)"),
        (["list", "--log", str(tmp_path / "none.db")], "audit list: verdict log"),
        (["report", "--log", str(tmp_path / "x.db"), "--since", "yesterday"],
         "audit report: 'yesterday' is not a time"),
    ]:
        err = io.StringIO()
        status = cli.main(["audit", *args], out=io.StringIO(), err=err)
        assert status in (1, 2) and err.getvalue().startswith(f"undercurrent: error: {message}"), err.getvalue()
    assert audit.parse_time("90m", now=10_000.0) == 10_000.0 - 5_400
    assert audit.parse_time("2026-12-07T06:00:00", now=0) == audit.parse_time("2026-12-07T06:00:00+00:00", now=0)


def test_the_writer_counts_every_record_written_dropped_or_abandoned(tmp_path):
    """A store held locked: the queue (3) fills and drops the rest; at close what
    is still unwritten is counted `closed`; nothing is lost without a count."""
    target = str(tmp_path / "log.db")
    registry = CollectorRegistry()
    log = VerdictLog(LogSettings(target, max_queue=3), LogMetrics(registry))
    version, probe = probe_version()
    lock = sqlite3.connect(target, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    record = abort_record(version, probe, np.zeros((1, HIDDEN), np.float32), row_layers=[1])
    accepted = [log.submit(record)]
    deadline = time.monotonic() + 20
    while registry.get_sample_value("undercurrent_router_verdict_log_write_errors_total") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    accepted += [log.submit(record) for _ in range(9)]  # the writer holds the first; 3 wait; 6 drop
    assert accepted == [True] * 4 + [False] * 6
    log.close()
    value = registry.get_sample_value
    assert value("undercurrent_router_verdict_log_dropped_total", {"reason": "queue_full"}) == 6
    assert value("undercurrent_router_verdict_log_dropped_total", {"reason": "closed"}) == 4
    assert value("undercurrent_router_verdict_log_written_total") == 0
    lock.execute("ROLLBACK")
    lock.close()
