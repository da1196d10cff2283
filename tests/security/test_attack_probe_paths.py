"""Attack: make a router read files it should not, through LoadProbe by path
(needs an admin token).

LoadProbe used to open any path the router process could read, follow
symlinks, read files of any size, answer differently for paths that exist and
paths that do not, and fail INTERNAL with a traceback on a crafted safetensors
header. Now a path names a probe under the router's probe root (--probe-root,
default --probes): anything that is not, or that resolves outside it through a
symlink, gets one answer whether it exists or not; a probe's files together
are capped (--max-probe-file-bytes); a malformed file is INVALID_ARGUMENT
naming the field. A router process on loopback.
"""

from __future__ import annotations

import json
import struct

import grpc
import numpy as np
import pytest

from common.probe_format.files import write_probe_file
from tests.router.helpers import HIDDEN, linear_probe, manifest
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc

MAX_PROBE_FILE_BYTES = 64 * 1024
OUTSIDE = "is not under the router's probe root (--probe-root); give it relative to the root"


async def load(router, path: str) -> tuple[str, str]:
    async with router.service.channel() as channel:
        try:
            reply = await admin_pb_grpc.ProbeAdminServiceStub(channel).LoadProbe(admin_pb.LoadProbeRequest(path=path))
        except grpc.aio.AioRpcError as err:
            return err.code().name, err.details()
    return "OK", reply.probe.name


@pytest.fixture
async def router(start_router_process, tmp_path):
    return await start_router_process("--max-probe-file-bytes", str(MAX_PROBE_FILE_BYTES))


async def test_paths_outside_the_probe_root_get_one_answer_whether_they_exist_or_not(router, tmp_path):
    root = tmp_path / "probes"
    outside = linear_probe(tmp_path / "elsewhere", "outside", np.ones(HIDDEN))  # a valid probe, outside
    (root / "link").symlink_to(outside)  # a symlink inside the root that leads out
    (root / "escape").mkdir()
    (root / "escape" / "manifest.json").symlink_to(outside / "manifest.json")
    attempts = {
        "/etc/passwd": "/etc/passwd",
        "/nonexistent/at/all": "/nonexistent/at/all",
        str(outside): str(outside),
        "../elsewhere/outside": "../elsewhere/outside",
        "../no-such-dir": "../no-such-dir",
        "link": "link",
        "p/../../elsewhere/outside": "p/../../elsewhere/outside",
    }
    answers = {path: await load(router, path) for path in attempts}
    assert answers == {path: ("INVALID_ARGUMENT", f"path: {shown!r} {OUTSIDE}") for path, shown in attempts.items()}
    # A directory inside whose file resolves outside: refused, naming only the file under the root.
    assert await load(router, "escape") == ("INVALID_ARGUMENT", "escape/manifest.json: resolves outside the probe root")
    # The router read none of it, and still serves its own probe.
    assert await load(router, "p") == ("ALREADY_EXISTS",
                                       "probe 'p' is already loaded (version '1'); set replace to swap it")
    logged = router.service.log_path.read_text(errors="replace")
    assert "Traceback" not in logged and str(tmp_path / "elsewhere") not in logged


async def test_a_probe_over_the_size_cap_is_refused_before_it_is_parsed(router, tmp_path):
    root = tmp_path / "probes"
    linear_probe(root, "big", np.ones(HIDDEN), description="x" * MAX_PROBE_FILE_BYTES)
    code, details = await load(router, "big")
    assert (code, details) == ("RESOURCE_EXHAUSTED", f"path: big/manifest.json takes the probe over "
                                                     f"{MAX_PROBE_FILE_BYTES} bytes (--max-probe-file-bytes)")
    # Under the cap, inside the root: loads.
    linear_probe(root, "small", np.ones(HIDDEN))
    assert await load(router, "small") == ("OK", "small")


def crafted(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header


@pytest.mark.parametrize("name, content, message", [
    ("list-header.safetensors", crafted(b"[1, 2, 3]"),
     "list-header.safetensors: not a safetensors file (the header is not a JSON object)"),
    ("number-metadata.safetensors", crafted(json.dumps({"__metadata__": {"undercurrent.manifest": 7}}).encode()),
     "number-metadata.safetensors: safetensors header: __metadata__ must map names to strings"),
    ("list-metadata.safetensors", crafted(json.dumps({"__metadata__": [1]}).encode()),
     "list-metadata.safetensors: safetensors header: __metadata__ must map names to strings"),
    ("long-header.safetensors", struct.pack("<Q", 2 ** 60) + b"{}",
     "long-header.safetensors: not a safetensors file (the header claims 1152921504606846976 bytes, the file "
     "has 2 after the length)"),
    ("binary.safetensors", crafted(b"\xff\xfe{"),
     "binary.safetensors: not a safetensors file (the header is not JSON)"),
])
async def test_crafted_probe_files_are_invalid_argument_naming_the_problem(router, tmp_path, name, content, message):
    (tmp_path / "probes" / name).write_bytes(content)
    assert await load(router, name) == ("INVALID_ARGUMENT", message)
    assert "Traceback" not in router.service.log_path.read_text(errors="replace")


async def test_a_crafted_manifest_inside_valid_safetensors_names_the_field(router, tmp_path):
    path = tmp_path / "probes" / "wrong.safetensors"
    write_probe_file(path, manifest("wrong", kind="linear"), {"weight": np.ones(HIDDEN), "bias": np.zeros(1)})
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header["__metadata__"]["undercurrent.manifest"] = json.dumps({**manifest("wrong"), "threshold": "high"})
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data[8 + length:])
    code, details = await load(router, "wrong.safetensors")
    assert code == "INVALID_ARGUMENT" and details.startswith("wrong.safetensors: manifest.threshold"), details
