"""Shadow and canary versions on a real router process over loopback gRPC:
what acts, what is counted, and what promote and roll back change."""

from __future__ import annotations

import io

import numpy as np
import pytest
from google.rpc import code_pb2

from common.canary import canary_takes
from common.probe_format.files import load_probe_bytes
from common.verdict_log.store import Query, open_store
from router_service.verdict_log import LogSettings
from tests.router.helpers import SessionClient, block
from tests.router.rollout_world import PROBE, Engine, admin, inline, rows, start_router
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client import cli

QUIET = 0.99  # sigmoid of the rows here never reaches it


def sample(name: str, **labels: str) -> str:
    """A sample's key as stack.scrape names it (labels in name order)."""
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


@pytest.fixture
async def router(tmp_path):
    directory = tmp_path / "probes"
    directory.mkdir()
    running = await start_router(directory, str(tmp_path / "verdicts.db"))
    yield running
    running.service.terminate()


async def load(router, version: str, threshold: float, role=types_pb.PROBE_ROLE_SERVING, share=0.0,
               action="abort") -> types_pb.ProbeInfo:
    async with admin(router) as stub:
        reply = await stub.LoadProbe(admin_pb.LoadProbeRequest(inline=inline(version, threshold, action), role=role,
                                                         canary_share=share))
    return reply.probe


async def run(engine: Engine, ids: list[str], values: np.ndarray) -> None:
    for rid in ids:
        engine.start(rid)
    for position in range(values.shape[1]):
        await engine.step({rid: (2 + position, float(values[i, position])) for i, rid in enumerate(ids)})
    await engine.end(*ids)


async def test_a_shadow_disagrees_exactly_where_it_would_have_acted_and_acts_on_none(router):
    serving = await load(router, "1", QUIET, action="observe")
    shadow = await load(router, "2", 0.5, role=types_pb.PROBE_ROLE_SHADOW)
    assert (shadow.role, serving.role) == (types_pb.PROBE_ROLE_SHADOW, types_pb.PROBE_ROLE_SERVING)
    values = np.random.default_rng(3).uniform(-3, 1, (30, 3)).astype(np.float32)
    ids = [f"shadowed-{i}" for i in range(len(values))]
    async with Engine(router) as engine:
        await engine.client.sync()
        assert engine.client.digests == {PROBE: serving.digest}  # engines never see the shadow
        await run(engine, ids, values)
    results = engine.results
    assert results.aborts == {} and results.other == []  # the shadow (action abort) acted on nothing
    # The serving version's scores tell where the shadow's threshold is crossed.
    would_act = {rid for rid, scores in results.scores.items() if max(scores) >= 0.5}
    assert len(results.scores) == len(ids) and 0 < len(would_act) < len(ids)
    assert {len(scores) for scores in results.scores.values()} == {values.shape[1]}  # the serving version's alone
    version = dict(probe=PROBE, version="2")
    await router.wait_metric(sample("undercurrent_router_shadow_disagreements_total", **version),
                             lambda v: v == len(would_act))
    requests = "undercurrent_router_shadow_requests_total"
    assert router.metric(sample(requests, **version, serving="quiet", shadow="fired")) == len(would_act)
    assert router.metric(sample(requests, **version, serving="quiet", shadow="quiet")) == len(ids) - len(would_act)
    assert router.metric(sample(requests, **version, serving="fired", shadow="fired")) == 0
    # The same weights: every row's delta is 0, in the bucket (-0.001, 0].
    rows = values.size
    assert router.metric(sample("undercurrent_router_shadow_score_delta_bucket", **version, le="+Inf")) == rows
    assert router.metric(sample("undercurrent_router_shadow_score_delta_bucket", **version, le="-0.001")) == 0
    assert router.metric(sample("undercurrent_router_shadow_score_delta_bucket", **version, le="0.0")) == rows

    # The log: a shadow record per request it would have acted on, an outcome per request.
    await router.wait_metric("undercurrent_router_verdict_log_written_total",
                             lambda v: v == len(would_act) + len(ids))
    store = open_store(router.log, create=False)
    shadows = store.records(Query(kind="shadow"))
    outcomes = store.outcomes(Query(probe=PROBE))
    store.close()
    assert {r.request_id for r in shadows} == would_act
    assert all(r.role == "shadow" and r.version == "2" and r.reference_score == r.score for r in shadows)
    assert len(outcomes) == len(ids) and sum(not o.agrees for o in outcomes) == len(would_act)
    out = io.StringIO()
    assert cli.main(["audit", "report", "--log", router.log, "--since", "1h"], out=out, err=io.StringIO()) == 0
    line = next(row.split() for row in out.getvalue().splitlines() if row.startswith(PROBE))
    assert line[:8] == [PROBE, "1", "2", str(len(ids)), str(len(ids) - len(would_act)), str(len(would_act)),
                        "0", str(len(would_act))]


async def test_a_25_percent_canary_acts_on_exactly_the_requests_its_hash_takes(router):
    await load(router, "1", QUIET)
    canary = await load(router, "2", 0.5, role=types_pb.PROBE_ROLE_CANARY, share=0.25)
    assert (canary.role, canary.canary_share) == (types_pb.PROBE_ROLE_CANARY, 0.25)
    ids = [f"canaried-{i}" for i in range(48)]
    taken = {rid for rid in ids if canary_takes(rid, 0.25)}
    assert 6 <= len(taken) <= 18  # about a quarter
    async with Engine(router) as engine:
        await engine.client.sync()
        assert engine.client.probes[PROBE].canary.digest == canary.digest  # engines pin it by its hash
        await run(engine, ids, np.full((len(ids), 2), 1.0, dtype=np.float32))  # version 2 fires on each row
    assert set(engine.results.aborts) == taken
    assert all("(version 2)" in verdict.reason for verdict in engine.results.aborts.values())
    await router.wait_metric("undercurrent_router_verdict_log_written_total", lambda v: v == len(taken))
    store = open_store(router.log, create=False)
    logged = store.records(Query())
    store.close()
    assert {(r.request_id, r.kind, r.role, r.version) for r in logged} == {
        (rid, "abort", "canary", "2") for rid in taken}


async def test_promote_and_roll_back_change_new_requests_only(router):
    v1 = await load(router, "1", QUIET)
    v2 = await load(router, "2", 0.5, role=types_pb.PROBE_ROLE_SHADOW)
    async with Engine(router) as engine:
        await engine.client.sync()
        engine.start("bound-before-promote")  # binds v1, with v2 as its shadow (rows of 1.0: v2 fires, v1 never)
        await engine.client.sync()
        async with admin(router) as stub:
            promoted = (await stub.PromoteProbe(admin_pb.PromoteProbeRequest(name=PROBE))).probe
        assert (promoted.digest, promoted.role) == (v2.digest, types_pb.PROBE_ROLE_SERVING)
        await engine.catalog_lists(v2.digest)
        engine.start("after-promote")  # binds v2
        await engine.step({"bound-before-promote": (2, 1.0), "after-promote": (2, 1.0)})
        assert set(engine.results.aborts) == {"after-promote"}  # the earlier request kept v1, and its shadow stays silent

        v3 = await load(router, "3", QUIET, role=types_pb.PROBE_ROLE_CANARY, share=1.0)
        await engine.catalog_lists(v2.digest, canary=v3.digest)
        engine.start("bound-to-canary")  # the canary takes every request: v3
        await engine.client.sync()
        async with admin(router) as stub:
            kept = (await stub.RollBackProbe(admin_pb.RollBackProbeRequest(name=PROBE))).probe
            listed = (await stub.ListProbes(admin_pb.ListProbesRequest())).probes
        assert kept.digest == v2.digest and [p.digest for p in listed] == [v2.digest]
        await engine.catalog_lists(v2.digest)
        # A binding pinned to the rolled-back canary (a request re-homed here, say) is
        # refused, never moved to the serving version.
        engine.client.start("pinned-to-v3", PROBE, prompt_tokens=2, digests={PROBE: v3.digest})
        [refused] = await engine.client.sync()
        assert refused.error.code == code_pb2.FAILED_PRECONDITION, refused
        assert f"version '2' ({v2.digest}) on this router; the request was bound to {v3.digest}" in \
            refused.error.message
        engine.start("after-roll-back")  # binds v2 again
        await engine.step({"bound-to-canary": (2, 1.0), "after-roll-back": (2, 1.0),
                           "bound-before-promote": (3, 1.0)})
        assert set(engine.results.aborts) == {"after-promote", "after-roll-back"}
        await engine.end("bound-before-promote", "after-promote", "bound-to-canary", "after-roll-back")
    assert v1.digest != v2.digest != v3.digest
    # The shadowed request's outcome: v1 quiet, its shadow v2 fired on both rows.
    await router.wait_metric(sample("undercurrent_router_shadow_requests_total", probe=PROBE, version="2",
                                    serving="quiet", shadow="fired"), lambda v: v == 1)


async def test_rollout_calls_refuse_what_does_not_fit(router):
    async with admin(router) as stub:
        for request, code, words in [
            (admin_pb.LoadProbeRequest(inline=inline("2", 0.5), role=types_pb.PROBE_ROLE_CANARY, canary_share=0.25),
             "NOT_FOUND", "a canary stands beside a serving version"),
            (admin_pb.PromoteProbeRequest(name=PROBE), "NOT_FOUND", "is not loaded"),
        ]:
            call = stub.LoadProbe if isinstance(request, admin_pb.LoadProbeRequest) else stub.PromoteProbe
            with pytest.raises(Exception) as refused:
                await call(request)
            assert refused.value.code().name == code and words in refused.value.details()
        await stub.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("1", QUIET)))
        cases = [
            (stub.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("2", 0.5), role=types_pb.PROBE_ROLE_CANARY,
                                                canary_share=1.5)), "INVALID_ARGUMENT", "canary_share: 1.5"),
            (stub.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("2", 0.5), role=types_pb.PROBE_ROLE_SHADOW,
                                                canary_share=0.5)), "INVALID_ARGUMENT", "not loaded as a canary"),
            (stub.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("1", QUIET), role=types_pb.PROBE_ROLE_SHADOW)),
             "FAILED_PRECONDITION", "the serving version itself"),
            (stub.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("2", 0.5), role=7)), "INVALID_ARGUMENT", "role"),
            (stub.RollBackProbe(admin_pb.RollBackProbeRequest(name=PROBE)), "FAILED_PRECONDITION", "no canary or shadow"),
        ]
        for call, code, words in cases:
            with pytest.raises(Exception) as refused:
                await call
            assert refused.value.code().name == code and words in refused.value.details(), refused.value.details()
        other_layer = inline("2", 0.5)
        other_layer.manifest_json = other_layer.manifest_json.replace('"layers": [1]', '"layers": [2]')
        with pytest.raises(Exception) as refused:
            await stub.LoadProbe(admin_pb.LoadProbeRequest(inline=other_layer, role=types_pb.PROBE_ROLE_SHADOW))
        assert refused.value.code().name == "INVALID_ARGUMENT" and "manifest.layers" in refused.value.details()
        await stub.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("2", 0.5), role=types_pb.PROBE_ROLE_SHADOW))
        for call, words in [
            (stub.UnloadProbe(admin_pb.UnloadProbeRequest(name=PROBE)), "before you unload it"),
            (stub.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("3", 0.5), replace=True)),
             "before you replace its serving version"),
            (stub.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("3", 0.5), role=types_pb.PROBE_ROLE_CANARY,
                                                canary_share=0.1)), "or set replace to swap it"),
        ]:
            with pytest.raises(Exception) as refused:
                await call
            assert refused.value.code().name in ("FAILED_PRECONDITION", "ALREADY_EXISTS")
            assert words in refused.value.details(), refused.value.details()


async def test_a_shadow_left_alone_by_a_forced_unload_still_scores_and_logs(make_router, tmp_path):
    """Rolled back, a shadow keeps the requests it had; its serving version unloaded by force,
    it still fires into the log (with no serving score to compare) and acts on nothing."""
    log = str(tmp_path / "verdicts.db")
    router = await make_router(verdict_log=LogSettings(log))
    for version, threshold, role in (("1", QUIET, types_pb.PROBE_ROLE_SERVING), ("2", 0.5, types_pb.PROBE_ROLE_SHADOW)):
        probe = inline(version, threshold)
        router.registry.load(load_probe_bytes(probe.manifest_json, probe.weights_safetensors), role=role)
    client = SessionClient(router)
    await client.open()
    client.start("r", PROBE, prompt_tokens=2)
    await client.sync()
    router.registry.roll_back(PROBE)
    router.registry.unload(PROBE, force=True)
    replies = await client.until_ack(client.batch(block(rows([1.0]), ["r"], [3])))
    assert [m.WhichOneof("message") for m in replies] == ["error", "ack"]  # the serving binding detached
    assert "unloaded by force" in replies[0].error.message
    client.end("r")
    await client.sync()
    await client.close()
    await router.shutdown(grace_period=0)  # writes what is queued
    store = open_store(log, create=False)
    [record] = store.records(Query())
    store.close()
    assert (record.kind, record.version, record.reference_score) == ("shadow", "2", None)


async def test_a_promoted_shadow_unloaded_by_force_leaves_its_requests_serving_binding_alone(make_router):
    """The engine knows no binding of a shadow: losing it is no error, and the
    serving version it shadowed goes on scoring the request."""
    router = await make_router()
    for version, threshold, role in (("1", QUIET, types_pb.PROBE_ROLE_SERVING), ("2", 0.5, types_pb.PROBE_ROLE_SHADOW)):
        probe = inline(version, threshold, action="observe")
        router.registry.load(load_probe_bytes(probe.manifest_json, probe.weights_safetensors), role=role)
    client = SessionClient(router)
    await client.open()
    client.start("r", PROBE, prompt_tokens=2)  # version 1, with version 2 as its shadow
    await client.sync()
    router.registry.promote(PROBE)
    router.registry.unload(PROBE, force=True)  # version 2, now serving, and the request's shadow
    replies = await client.until_ack(client.batch(block(rows([1.0]), ["r"], [3])))
    assert [m.WhichOneof("message") for m in replies] == ["scores", "ack"], replies
    assert list(replies[0].scores.probe_scores.scores) == pytest.approx([1 / (1 + np.exp(-1.0))])  # version 1's score
    client.end("r")
    await client.sync()
    await client.close()
