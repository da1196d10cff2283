"""The verdict log of real router processes: one record per verdict and abort
the Session's client received, on SQLite and on a real PostgreSQL server;
replay of every abort; the log across a router restart; a stalled store."""

from __future__ import annotations

import io
import sqlite3

import numpy as np
import pytest

from common.verdict_log.store import Query, open_store
from tests.router import rollout_world as world
from tests.router.rollout_world import PROBE, Engine, admin, inline, sigmoid, start_router
from tools.postgres_server import PostgresServer, PostgresUnavailable
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent_client import cli

WATCHER = "observer"  # an observe binding beside the aborting one
ABORT_AT, OBSERVE_AT = 0.5, 0.7


@pytest.fixture(scope="module")
def postgres():
    try:
        server = PostgresServer().start()
    except PostgresUnavailable as reason:
        pytest.skip(str(reason))
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def log_target(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "log" / "verdicts.db")
    server = request.getfixturevalue("postgres")
    with _fresh(server.url):
        pass
    return server.url


class _fresh:
    """Empties the PostgreSQL log between tests of one server."""

    def __init__(self, url: str):
        self.store = open_store(url)

    def __enter__(self):
        with self.store.transaction():
            self.store.connection.execute("TRUNCATE verdicts, probe_versions, shadow_outcomes")

    def __exit__(self, *exc):
        self.store.close()


def probes_dir(tmp_path):
    directory = tmp_path / "probes"
    directory.mkdir(exist_ok=True)
    return directory


async def load_probes(router):
    async with admin(router) as stub:
        await stub.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("1", ABORT_AT)))
        observer = inline("1", OBSERVE_AT, action="observe")
        observer.manifest_json = observer.manifest_json.replace(f'"{PROBE}"', f'"{WATCHER}"')
        await stub.LoadProbe(admin_pb.LoadProbeRequest(inline=observer))


def first_elements(count: int, seed: int) -> np.ndarray:
    """Per request, 3 rows' first elements: some requests cross 0 (abort), some 0.85 (observe)."""
    return np.random.default_rng(seed).uniform(-2.5, 1.5, (count, 3)).astype(np.float32)


async def run_requests(engine: Engine, prefix: str, values: np.ndarray) -> list[str]:
    ids = [f"{prefix}-{i}" for i in range(len(values))]
    await engine.client.sync()  # the hello's catalog, then the loads' catalogs, are in
    for i, rid in enumerate(ids):
        engine.start(rid, caller="alice" if i % 2 == 0 else "bob", probes=(PROBE, WATCHER))
    for position in range(values.shape[1]):
        await engine.step({rid: (2 + position, float(values[i, position])) for i, rid in enumerate(ids)})
    await engine.end(*ids)
    return ids


def stored(target: str, **query) -> list:
    store = open_store(target, create=False)
    try:
        return store.records(Query(**query))
    finally:
        store.close()


def audit(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = cli.main(["audit", *args], out=out, err=err)
    return status, out.getvalue(), err.getvalue()


async def test_one_record_per_verdict_and_abort_replayable_and_kept_across_restart(tmp_path, log_target):
    directory = probes_dir(tmp_path)
    values = first_elements(16, seed=7)
    router = await start_router(directory, log_target)
    try:
        await load_probes(router)
        async with Engine(router) as engine:
            ids = await run_requests(engine, "run", values)
        results = engine.results
        # What the client saw: an abort where a row first crossed 0; observe scores per request.
        expected_aborts = {rid for rid, v in zip(ids, values) if (v >= 0).any()}
        assert set(results.aborts) == expected_aborts and 0 < len(expected_aborts) < len(ids)
        observed = {rid for rid, scores in results.scores.items() if max(scores) >= OBSERVE_AT}
        assert 0 < len(observed) < len(ids)
        expected = len(results.aborts) + len(observed)
        await router.wait_metric("undercurrent_router_verdict_log_written_total", lambda v: v >= expected)
        assert router.metric('undercurrent_router_verdict_log_dropped_total{reason="queue_full"}') == 0
    finally:
        router.service.terminate()

    records = stored(log_target)
    assert len(records) == expected  # the router has stopped: nothing more comes
    aborts = [r for r in records if r.kind == "abort"]
    verdicts = [r for r in records if r.kind == "verdict"]
    assert {r.request_id for r in aborts} == set(results.aborts)
    assert {r.request_id for r in verdicts} == observed
    assert {r.probe for r in aborts} == {PROBE} and {r.probe for r in verdicts} == {WATCHER}
    for r in aborts:
        sent = results.aborts[r.request_id]
        i = ids.index(r.request_id)
        first = int(np.flatnonzero(values[i] >= 0)[0])
        assert (r.token_position, r.layer, r.role, r.version, r.router) == (2 + first, 1, "serving", "1", "router-a")
        assert r.caller == ("alice" if i % 2 == 0 else "bob")
        assert r.score == pytest.approx(sigmoid(values[i, first]), rel=1e-6)
        assert np.float32(r.score) == np.float32(sent.score) and r.threshold == ABORT_AT
        assert r.rows.shape == (1, world.HIDDEN) and r.rows[0, 0] == values[i, first]
    for r in verdicts:
        assert r.rows is None and r.score >= OBSERVE_AT and r.threshold == OBSERVE_AT

    # Replay re-scores each abort from the log alone.
    for rid in sorted(results.aborts)[:4]:
        status, out, err = audit("replay", rid, "--log", log_target)
        assert status == 0, err
        assert "the same score and verdict" in out
    status, out, _ = audit("list", "--log", log_target, "--caller", "alice", "--verdict", "abort")
    listed = {line.split()[3] for line in out.splitlines()[1:]}
    assert status == 0 and listed == {r.request_id for r in aborts if r.caller == "alice"}

    # A new router process on the same log: the records are there, and new ones add to them.
    router = await start_router(directory, log_target)
    try:
        await load_probes(router)
        assert len(stored(log_target)) == expected
        async with Engine(router) as engine:
            await run_requests(engine, "after", np.array([[1.0, -1.0, -1.0]], dtype=np.float32))
        assert set(engine.results.aborts) == {"after-0"}
        await router.wait_metric("undercurrent_router_verdict_log_written_total", lambda v: v >= 2)
    finally:
        router.service.terminate()
    assert len(stored(log_target)) == expected + 2  # its abort, and the observer's verdict (sigmoid(1) >= 0.7)
    assert [r.kind for r in stored(log_target, request_id="after-0")] == ["abort", "verdict"]


async def test_a_stalled_store_drops_and_counts_while_scoring_goes_on(tmp_path):
    target = str(tmp_path / "verdicts.db")
    router = await start_router(probes_dir(tmp_path), target, "--verdict-log-queue", "4")
    lock = sqlite3.connect(target, isolation_level=None)
    try:
        await load_probes(router)
        lock.execute("BEGIN EXCLUSIVE")  # the store now refuses every write
        values = np.full((40, 1), 1.0, dtype=np.float32)  # every request aborts at its first row
        async with Engine(router) as engine:
            ids = await run_requests(engine, "stalled", values)
        assert set(engine.results.aborts) == set(ids)  # scoring went on: every abort arrived
        total = 2 * len(ids)  # an abort and an observer's verdict per request
        dropped = 'undercurrent_router_verdict_log_dropped_total{reason="queue_full"}'
        assert router.metric(dropped) > 0
        assert router.metric("undercurrent_router_verdict_log_written_total") == 0
        await router.wait_metric("undercurrent_router_verdict_log_write_errors_total", lambda v: v >= 1)
        lost = router.metric(dropped)  # final: records drop only when submitted
        lock.execute("ROLLBACK")
        written = await router.wait_metric("undercurrent_router_verdict_log_written_total",
                                           lambda v: v == total - lost)
        await router.wait_metric("undercurrent_router_verdict_log_queued", lambda v: v == 0)
    finally:
        lock.close()
        router.service.terminate()
    assert len(stored(target)) == written
