"""Probes are data: JSON and safetensors, never pickle; inline loads are capped."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import grpc
import numpy as np
import pytest

from common.probe_format.files import ProbeFileError, load_probe_path
from tests.conftest import REPO
from tests.router.helpers import HIDDEN, channel, manifest
from tests.router.test_admin import inline
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc


async def test_an_inline_probe_over_the_cap_is_resource_exhausted_and_not_loaded(make_router):
    small = inline("small", np.ones(HIDDEN))
    cap = len(small.manifest_json) + len(small.weights_safetensors)
    router = await make_router(None, max_inline_probe_bytes=cap)
    admin = admin_pb_grpc.ProbeAdminServiceStub(channel(router))
    assert (await admin.LoadProbe(admin_pb.LoadProbeRequest(inline=small))).probe.name == "small"
    big = inline("big", np.ones(HIDDEN), description="x")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await admin.LoadProbe(admin_pb.LoadProbeRequest(inline=big))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    size = len(big.manifest_json) + len(big.weights_safetensors)
    assert refused.value.details() == (
        f"inline: {size} bytes of manifest and weights, at most {cap} "
        "(--max-inline-probe-bytes; larger probes load from a path)")
    assert [p.name for p in router.registry.probes()] == ["small"]


class _Payload:
    """Unpickling this would run code (it would create the marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pickle ran"))


def test_pickled_weights_are_refused_without_being_unpickled(tmp_path):
    marker = tmp_path / "ran"
    probe = tmp_path / "p"
    probe.mkdir()
    (probe / "manifest.json").write_text(json.dumps(manifest("p")))
    (probe / "weights.safetensors").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(ProbeFileError):
        load_probe_path(probe)
    (tmp_path / "p.safetensors").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(ProbeFileError):
        load_probe_path(tmp_path / "p.safetensors")
    assert not marker.exists()


def test_no_service_code_can_unpickle():
    """pickle, torch.load and np.load(allow_pickle=True) appear nowhere in the services."""
    forbidden = re.compile(r"\bimport pickle\b|\bpickle\.loads?\b|torch\.load\b|allow_pickle\s*=\s*True|"
                           r"\bjoblib\b|\bdill\b|cloudpickle")
    offenders = [
        f"{path.relative_to(REPO)}:{number}"
        for folder in ("common", "router_service", "engine_service")
        for path in (REPO / folder).rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if forbidden.search(line)
    ]
    assert offenders == []
