"""`undercurrent probes ...` and usage errors, as processes, against a real router."""

import asyncio
import subprocess
import sys

import numpy as np
import pytest

from common.probe_format.files import write_probe
from tests.router.helpers import HIDDEN, manifest

CLI = [sys.executable, "-m", "undercurrent_client"]


async def cli(*args: str) -> tuple[int, str, str]:
    """Runs the command without blocking the router that shares this event loop."""
    process = await asyncio.create_subprocess_exec(
        *CLI, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode, out.decode(), err.decode()


async def test_probes_load_list_unload(router, tmp_path):
    target = ["--router", f"127.0.0.1:{router.port}"]
    spec = manifest("watch", "linear", threshold=0.25, action="observe", layers=[2], version="7")
    write_probe(tmp_path / "watch", spec, {"weight": np.ones(HIDDEN, np.float32)})

    assert await cli("probes", "list", *target) == (0, "no probes loaded\n", "")
    code, out, err = await cli("probes", "load", str(tmp_path / "watch"), "--upload", *target)
    assert (code, err) == (0, "")
    assert out == "loaded watch (version 7): linear on residual_stream layers 2, observe at 0.25\n"
    code, out, _ = await cli("probes", "list", *target)
    assert code == 0
    assert out.splitlines() == [
        "NAME   KIND    TENSOR           LAYERS  ACTION   THRESHOLD  VERSION  ACTIVE",
        "watch  linear  residual_stream  2       observe  0.25       7        0",
    ]
    code, out, err = await cli("probes", "load", str(tmp_path / "watch"), "--upload", *target)
    assert (code, out) == (1, "")
    assert err.startswith("undercurrent: error: LoadProbe failed with ALREADY_EXISTS: ")
    assert err.count("\n") == 1
    assert await cli("probes", "unload", "watch", *target) == (0, "unloaded watch\n", "")
    code, out, err = await cli("probes", "unload", "watch", *target)
    assert (code, out) == (1, "")
    assert err == "undercurrent: error: UnloadProbe failed with NOT_FOUND: probe 'watch' is not loaded\n"


async def test_probes_shadow_canary_promote_roll_back(router, tmp_path):
    target = ["--router", f"127.0.0.1:{router.port}"]
    for version in ("1", "2", "3"):
        spec = manifest("watch", "linear", threshold=0.25, action="observe", layers=[2], version=version)
        write_probe(tmp_path / f"v{version}", spec, {"weight": np.ones(HIDDEN, np.float32)})
    assert (await cli("probes", "load", str(tmp_path / "v1"), "--upload", *target))[0] == 0
    code, out, err = await cli("probes", "load", str(tmp_path / "v2"), "--upload", "--shadow", *target)
    assert (code, err) == (0, "") and out.startswith("loaded watch (version 2) as shadow: linear")
    code, out, _ = await cli("probes", "list", *target)
    assert [line.split()[-2:] for line in out.splitlines()] == [["ACTIVE", "ROLE"], ["0", "serving"],
                                                                ["0", "shadow"]]
    assert await cli("probes", "promote", "watch", *target) == (
        0, "watch: version 2 serves new requests; running requests keep their versions\n", "")
    code, out, _ = await cli("probes", "load", str(tmp_path / "v3"), "--upload", "--canary", "0.25", *target)
    assert out.startswith("loaded watch (version 3) as canary 0.25: linear")
    assert await cli("probes", "roll-back", "watch", *target) == (
        0, "watch: version 2 alone serves new requests; running requests keep their versions\n", "")
    code, out, err = await cli("probes", "roll-back", "watch", *target)
    assert (code, out) == (1, "")
    assert err == ("undercurrent: error: RollBackProbe failed with FAILED_PRECONDITION: probe 'watch' has no "
                   "canary or shadow to roll back\n")
    code, _, err = await cli("probes", "load", str(tmp_path / "v3"), "--shadow", "--canary", "0.5", *target)
    assert code == 2 and "not allowed with argument" in err


async def test_load_by_router_path_reports_a_bad_manifest_field(router, tmp_path):
    write_probe(tmp_path / "ok", manifest("ok", "linear", threshold=0.0),
                {"weight": np.ones(HIDDEN, np.float32)})
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text('{"name": "bad", "kind": "linear"}')
    target = ["--router", f"127.0.0.1:{router.port}"]
    code, out, _ = await cli("probes", "load", str(tmp_path / "ok"), *target)
    assert code == 0 and out.startswith("loaded ok (version 1): linear")
    code, _, err = await cli("probes", "load", str(tmp_path / "bad"), *target)
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("undercurrent: error: LoadProbe failed with INVALID_ARGUMENT: ")
    assert "manifest" in err


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: COMMAND"),
    (["probes", "list"], "--router HOST:PORT is required (or set $UNDERCURRENT_ROUTER)"),
    (["generate", "hi", "--engine", "x:1", "--max-tokens", "many"], "--max-tokens: invalid int value"),
    (["capture", "hi", "--engine", "x:1", "--out", "f"], "the following arguments are required: --point"),
    (["capture", "hi", "--engine", "x:1", "--out", "f", "--point", "resid:1"],
     "--point 'resid:1': tensor type 'resid' is not one of"),
    (["capture", "--engine", "x:1", "--out", "f", "--point", "mlp_out:1"],
     "give at least one PROMPT or --prompts-file"),
    (["probes", "load", "/nowhere", "--upload", "--router", "127.0.0.1:1"],
     "/nowhere: no such file or directory"),
    (["model-info", "--engine", "x:1", "--tls-root-cert", "/no/ca.pem"],
     "--tls-root-cert '/no/ca.pem' is not a file"),
])
def test_usage_errors_are_one_line_and_exit_2(args, message):
    result = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith("undercurrent: error: ") and result.stderr.count("\n") == 1
    assert message in result.stderr


def test_unreachable_service_names_the_status():
    result = subprocess.run([*CLI, "model-info", "--engine", "127.0.0.1:1"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.startswith("undercurrent: error: GetModelInfo failed with UNAVAILABLE: ")
    assert result.stderr.count("\n") == 1


def test_console_script_is_the_cli_main():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"undercurrent": "undercurrent_client.cli:main"}
