"""ProbeAdminClient and AsyncProbeAdminClient against a real router on loopback."""

import asyncio
import json

import grpc
import numpy as np
import pytest

from common.probe_format.files import write_probe, write_probe_file
from tests.router.helpers import HIDDEN, manifest
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client import AsyncProbeAdminClient, ProbeAdminClient, RpcError, inline_probe

E0 = np.eye(HIDDEN, dtype=np.float32)[0]


def observe_probe(directory, name, **fields):
    spec = manifest(name, "linear", threshold=0.0, action="observe", **fields)
    return write_probe(directory / name, spec, {"weight": E0, "bias": np.array([0.5])})


async def test_async_admin_uploads_lists_and_unloads(router, tmp_path):
    local = observe_probe(tmp_path / "local", "uploaded", layers=[2])
    single = write_probe_file(tmp_path / "single.safetensors",
                              manifest("single", "linear", threshold=1.5, action="abort"),
                              {"weight": E0})
    on_router = observe_probe(tmp_path / "router-side", "by_path")
    async with AsyncProbeAdminClient(f"127.0.0.1:{router.port}") as admin:
        info = await admin.load(upload=local)
        assert (info.name, info.kind, list(info.layers), info.action) == (
            "uploaded", types_pb.PROBE_KIND_LINEAR, [2], types_pb.PROBE_ACTION_OBSERVE)
        info = await admin.load(upload=single)
        assert (info.name, info.threshold, info.action) == ("single", 1.5, types_pb.PROBE_ACTION_ABORT)
        assert (await admin.load(on_router)).name == "by_path"
        assert sorted(p.name for p in await admin.list()) == ["by_path", "single", "uploaded"]
        assert await admin.unload("single") is True
        assert sorted(p.name for p in await admin.list()) == ["by_path", "uploaded"]


async def test_async_admin_errors_carry_status_and_field(router, tmp_path):
    async with AsyncProbeAdminClient(f"127.0.0.1:{router.port}") as admin:
        with pytest.raises(RpcError) as missing:
            await admin.unload("nothing")
        assert missing.value.code == grpc.StatusCode.NOT_FOUND
        assert missing.value.method == "UnloadProbe" and "'nothing'" in missing.value.details

        bad = admin_pb.InlineProbe(manifest_json=json.dumps(manifest("bad", "linear", hidden_size=0)))
        with pytest.raises(RpcError) as invalid:
            await admin.load(inline=bad)
        assert invalid.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "hidden_size" in invalid.value.details

        probe = observe_probe(tmp_path, "twice")
        await admin.load(upload=probe)
        with pytest.raises(RpcError) as exists:
            await admin.load(upload=probe)
        assert exists.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert (await admin.load(upload=probe, replace=True)).name == "twice"


async def test_blocking_admin_does_the_same(router, tmp_path):
    """The blocking client runs in a thread: the router shares this test's event loop."""
    local = observe_probe(tmp_path, "blocking")

    def session() -> tuple[list[str], bool, list[str], grpc.StatusCode]:
        with ProbeAdminClient(f"127.0.0.1:{router.port}") as admin:
            admin.load(upload=local)
            listed = [p.name for p in admin.list()]
            gone = admin.unload("blocking")
            after = [p.name for p in admin.list()]
            try:
                admin.unload("blocking")
            except RpcError as err:
                return listed, gone, after, err.code
        raise AssertionError("a second unload succeeded")

    listed, gone, after, code = await asyncio.to_thread(session)
    assert (listed, gone, after, code) == (["blocking"], True, [], grpc.StatusCode.NOT_FOUND)


async def test_unreachable_router_is_unavailable():
    async with AsyncProbeAdminClient("127.0.0.1:1", timeout=5) as admin:
        with pytest.raises(RpcError) as failure:
            await admin.list()
    assert failure.value.code == grpc.StatusCode.UNAVAILABLE


def test_local_probe_files_are_read_or_refused_by_path(tmp_path):
    directory = observe_probe(tmp_path, "files")
    inline = inline_probe(directory)
    assert json.loads(inline.manifest_json)["name"] == "files" and inline.weights_safetensors
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbage.safetensors").write_bytes(b"garbage")
    for path, message in [(tmp_path / "empty", "no manifest.json"),
                          (tmp_path / "garbage.safetensors", "not a safetensors file"),
                          (tmp_path / "missing", "no such file"),
                          (directory / "manifest.json", "expected a probe directory")]:
        with pytest.raises(ValueError, match=message) as err:
            inline_probe(path)
        assert str(path) in str(err.value)
    with pytest.raises(ValueError, match="exactly one of path"):
        ProbeAdminClient("127.0.0.1:1").load()
