"""ProbeAdmin live on a router with open sessions, and gRPC health."""

import asyncio
import json

import grpc
import numpy as np
import pytest
from google.rpc import code_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.probe_format.files import ProbeRoot, encode_safetensors
from tests.router.helpers import HIDDEN, SessionClient, block, channel, errors, kinds, linear_probe, manifest
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc

E0 = np.eye(HIDDEN)[0]


def admin(router):
    return admin_pb_grpc.ProbeAdminServiceStub(channel(router))


def inline(name, weight, **fields):
    spec = manifest(name, "linear", threshold=0.0, action="observe", **fields)
    return admin_pb.InlineProbe(manifest_json=json.dumps(spec),
                          weights_safetensors=encode_safetensors({"weight": weight}, "float32"))


async def health_status(router):
    stub = health_pb2_grpc.HealthStub(channel(router))
    reply = await stub.Check(health_pb2.HealthCheckRequest(service="undercurrent.v1.ProbeRouterService"))
    return reply.status


async def test_load_list_unload_live_without_dropping_the_session(make_router, tmp_path):
    linear_probe(tmp_path / "dir", "first", E0, kind="linear", threshold=0.0, action="observe")
    router = await make_router(tmp_path / "dir", probe_root=ProbeRoot(tmp_path))
    stub = admin(router)
    client = SessionClient(router)
    await client.open()

    # Load by path and inline: each pushes a catalog to the open session.
    path = linear_probe(tmp_path / "more", "by_path", E0 * 2, kind="linear", threshold=0.0, action="observe")
    info = (await stub.LoadProbe(admin_pb.LoadProbeRequest(path=str(path.relative_to(tmp_path))))).probe
    assert (info.name, info.kind, list(info.layers)) == ("by_path", types_pb.PROBE_KIND_LINEAR, [1])
    catalog = (await client.until("catalog")).catalog
    assert [p.name for p in catalog.probes] == ["by_path", "first"]
    await stub.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("inline", E0 * 3)))
    catalog = (await client.until("catalog")).catalog
    assert [p.name for p in catalog.probes] == ["by_path", "first", "inline"]
    listed = await stub.ListProbes(admin_pb.ListProbesRequest())
    assert [p.name for p in listed.probes] == ["by_path", "first", "inline"]

    # The new probes score on the same session.
    client.start("r", "by_path", "inline", prompt_tokens=0)
    replies = await client.until_ack(client.batch(block(np.ones((1, HIDDEN)), ["r"], [0])))
    scored = [m.scores.probe_scores for m in replies if m.WhichOneof("message") == "scores"]
    assert sorted((s.probe, s.scores[0]) for s in scored) == [("by_path", 2.0), ("inline", 3.0)]

    # Unload of a probe in use waits for its request; new requests may not bind it.
    reply = await stub.UnloadProbe(admin_pb.UnloadProbeRequest(name="by_path"))
    assert reply.unloaded is False
    listed = {p.name: p for p in (await stub.ListProbes(admin_pb.ListProbesRequest())).probes}
    assert (listed["by_path"].unloading, listed["by_path"].active_requests) == (True, 1)
    client.start("s", "by_path")
    replies = await client.sync()
    assert [(e.request_id, e.code) for e in errors(replies)] == [("s", code_pb2.FAILED_PRECONDITION)]
    assert "being unloaded" in errors(replies)[0].message
    replies = await client.until_ack(client.batch(block(np.ones((1, HIDDEN)), ["r"], [1])))
    assert "by_path" in [m.scores.probe_scores.probe for m in replies]  # still scoring its running request
    client.end("r")
    catalog = (await client.until("catalog")).catalog
    assert [p.name for p in catalog.probes] == ["first", "inline"]
    assert [p.name for p in (await stub.ListProbes(admin_pb.ListProbesRequest())).probes] == ["first", "inline"]
    assert router.live_requests() == 1  # "s" is running, with no bindings
    await client.close()


async def test_forced_unload_detaches_running_requests_with_an_error(make_router, tmp_path):
    linear_probe(tmp_path, "p", E0, kind="linear", threshold=0.0, action="observe")
    router = await make_router(tmp_path)
    stub = admin(router)
    client = SessionClient(router)
    await client.open()
    client.start("r", "p", prompt_tokens=0)
    await client.sync()
    assert (await stub.UnloadProbe(admin_pb.UnloadProbeRequest(name="p", force=True))).unloaded is True
    replies = await client.until_ack(client.batch(block(np.ones((1, HIDDEN)), ["r"], [0])))
    assert kinds(replies) == ["error", "ack"]
    assert (replies[0].error.request_id, replies[0].error.probe, replies[0].error.code) == ("r", "p", code_pb2.NOT_FOUND)
    assert "unloaded by force" in replies[0].error.message
    client.end("r")
    await client.sync()
    assert router.live_requests() == 0
    await client.close()


async def test_replace_keeps_running_requests_on_the_old_version_and_refuses_it_to_new_ones(make_router, tmp_path):
    linear_probe(tmp_path, "p", E0, kind="linear", threshold=0.0, action="observe")
    router = await make_router(tmp_path)
    stub = admin(router)
    client = SessionClient(router)
    await client.open()
    client.start("old", "p", prompt_tokens=0)
    await client.sync()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("p", E0 * 10, version="2")))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "probe 'p' is already loaded (version '1'); set replace" in err.value.details()
    old_digest = client.digests["p"]
    info = (await stub.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("p", E0 * 10, version="2"), replace=True))).probe
    assert info.version == "2" and info.digest != old_digest
    assert (await client.until("catalog")).catalog.probes[0].digest == info.digest
    client.start("new", "p", prompt_tokens=0)
    # A request pinned to the version that was replaced is refused, naming the probe and both versions.
    client.start("late", "p", prompt_tokens=0, digests={"p": old_digest})
    rows = np.ones((3, HIDDEN))
    replies = await client.until_ack(client.batch(block(rows, ["old", "new", "late"], [0, 0, 0])))
    scored = [m.scores.probe_scores for m in replies if m.WhichOneof("message") == "scores"]
    assert {s.request_id: s.scores[0] for s in scored} == {"old": 1.0, "new": 10.0}
    refusal = next(m.error for m in replies if m.error.request_id == "late" and not m.error.step)
    assert (refusal.code, refusal.probe) == (code_pb2.FAILED_PRECONDITION, "p")
    assert refusal.message == (f"request_start.bindings[0]: probe 'p' is version '2' ({info.digest}) on this "
                               f"router; the request was bound to {old_digest}")
    await client.close()


async def test_admin_errors_map_to_status_codes(make_router, tmp_path):
    router = await make_router(tmp_path, probe_root=ProbeRoot(tmp_path))
    stub = admin(router)
    cases = [
        (stub.UnloadProbe(admin_pb.UnloadProbeRequest(name="ghost")), grpc.StatusCode.NOT_FOUND,
         "probe 'ghost' is not loaded"),
        (stub.LoadProbe(admin_pb.LoadProbeRequest(path="missing")),
         grpc.StatusCode.INVALID_ARGUMENT, "missing: no such file or directory"),
        (stub.LoadProbe(admin_pb.LoadProbeRequest(inline=admin_pb.InlineProbe(manifest_json='{"name": "x"}'))),
         grpc.StatusCode.INVALID_ARGUMENT, "manifest.version: missing"),
        (stub.LoadProbe(admin_pb.LoadProbeRequest()), grpc.StatusCode.INVALID_ARGUMENT,
         "LoadProbeRequest: set path or inline"),
    ]
    for call, code, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == code and message in err.value.details()


async def test_health_follows_loaded_probes_and_drain(make_router, tmp_path):
    router = await make_router(tmp_path)  # an empty probes dir
    assert await health_status(router) == health_pb2.HealthCheckResponse.NOT_SERVING
    stub = admin(router)
    await stub.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("p", E0)))
    assert await health_status(router) == health_pb2.HealthCheckResponse.SERVING
    await stub.UnloadProbe(admin_pb.UnloadProbeRequest(name="p"))
    assert await health_status(router) == health_pb2.HealthCheckResponse.NOT_SERVING
    await stub.LoadProbe(admin_pb.LoadProbeRequest(inline=inline("p", E0)))
    assert await health_status(router) == health_pb2.HealthCheckResponse.SERVING
    client = SessionClient(router)
    await client.open()
    client.start("r", "p")
    await client.sync()
    shutdown = asyncio.create_task(router.shutdown(grace_period=5.0))
    await client.until("drain")
    assert await health_status(router) == health_pb2.HealthCheckResponse.NOT_SERVING
    client.end("r")
    await asyncio.wait_for(shutdown, 5.0)
    await client.close()
