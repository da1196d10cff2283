"""`python -m router_service` as a real process: health, metrics, SIGTERM, bad input."""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
from google.rpc import code_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.router.helpers import HIDDEN, SessionClient, channel, errors, linear_probe, manifest
from router_service.cli import parse_args
from tests.conftest import REPO
from tools.processes import free_port


def run_router(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "router_service", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


async def test_serves_health_and_metrics_drains_on_sigterm_and_exits_cleanly(tmp_path):
    linear_probe(tmp_path, "p", np.ones(HIDDEN))
    metrics_port = free_port()
    proc = run_router("--port", "0", "--host", "127.0.0.1", "--probes", str(tmp_path),
                      "--metrics-port", str(metrics_port), "--grace-period", "10", "--insecure")
    try:
        line = await asyncio.to_thread(proc.stdout.readline)
        assert line.startswith("router listening on 127.0.0.1:"), (line, proc.stderr.read())
        port = int(line.rsplit(":", 1)[1])
        reply = await health_pb2_grpc.HealthStub(channel(port)).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode())
        assert "undercurrent_router_probes 1.0" in text and "undercurrent_router_live_requests 0.0" in text

        client = SessionClient(port)
        hello = await client.open()
        assert [p.name for p in hello.probes] == ["p"]
        client.start("running", "p")
        await client.sync()
        proc.send_signal(signal.SIGTERM)
        assert "shutting down" in (await client.until("drain")).drain.reason
        client.start("late", "p")
        assert [(e.request_id, e.code) for e in errors(await client.sync())] == [("late", code_pb2.UNAVAILABLE)]
        assert proc.poll() is None  # waits for "running"
        client.end("running")
        await client.sync()
        assert await asyncio.to_thread(proc.wait, 10) == 0
        await client.close()
    finally:
        proc.kill()
        proc.wait()
    logs = [json.loads(line) for line in proc.stderr.read().splitlines()]
    messages = [entry["msg"] for entry in logs]
    assert "router started" in messages and "draining" in messages and messages[-1] == "stopped"
    assert any(e["level"] == "warning" and e["msg"].startswith("--insecure: serving PLAINTEXT") for e in logs)
    assert next(e for e in logs if e["msg"] == "probe loaded")["probe"] == "p"
    # The heap left by start-up (grpc, numpy, protobuf: tens of thousands of objects) is frozen.
    assert next(e for e in logs if e["msg"] == "start-up heap frozen")["objects"] > 10_000
    assert next(e for e in logs if e["msg"] == "stopped")["requests_cut_off"] == 0


def one_line_failure(*args):
    proc = run_router(*args)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "0", "--probes", "{tmp}", "--bogus"], "unrecognized arguments: --bogus"),
        (["--port", "0", "--probes", "{tmp}/nope"], "--probes {tmp}/nope: not a directory"),
        (["--port", "0"], "the following arguments are required: --probes"),
        (["--port", "0", "--probes", "{tmp}", "--grace-period", "0"], "--grace-period must be > 0"),
        (["--port", "0", "--probes", "{tmp}", "--max-sessions", "0"], "--max-sessions must be > 0"),
        (["--port", "0", "--probes", "{tmp}", "--max-requests-per-session", "-1"],
         "--max-requests-per-session must be > 0"),
        (["--port", "0", "--probes", "{tmp}", "--verdict-log-queue", "0"], "--verdict-log-queue must be > 0"),
        (["--port", "0", "--probes", "{tmp}", "--verdict-log-max-rows", "-1"],
         "--verdict-log-max-rows must be >= 0"),
    ],
)
def test_bad_command_lines_fail_with_one_line(tmp_path, capsys, argv, message):
    """Checked in-process (the subprocess path is the same parse_args)."""
    with pytest.raises(SystemExit) as exit_:
        parse_args([a.format(tmp=tmp_path) for a in argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == f"router_service: error: {message.format(tmp=tmp_path)}\n"


def test_limit_flags_and_their_defaults(tmp_path):
    args = parse_args(["--port", "0", "--probes", str(tmp_path)])
    assert (args.max_message_bytes, args.max_sessions, args.max_requests_per_session) == (64 * 1024 * 1024, 256, 4096)
    args = parse_args(["--port", "0", "--probes", str(tmp_path), "--max-message-bytes", "1048576",
                       "--max-sessions", "3", "--max-requests-per-session", "7"])
    assert (args.max_message_bytes, args.max_sessions, args.max_requests_per_session) == (1048576, 3, 7)


def test_port_in_use_and_a_broken_probe_fail_with_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = one_line_failure("--port", str(port), "--host", "127.0.0.1", "--probes", str(tmp_path),
                               "--insecure")
    assert f"cannot listen on 127.0.0.1:{port}" in err
    linear_probe(tmp_path, "bad", np.ones(HIDDEN))
    (tmp_path / "bad" / "manifest.json").write_text(json.dumps(manifest("bad") | {"layers": "x"}))
    err = one_line_failure("--port", "0", "--probes", str(tmp_path), "--insecure")
    assert err == (f"router_service: error: {tmp_path / 'bad'}: manifest.layers: expected list, got str 'x'")




def test_a_verdict_log_that_cannot_be_opened_fails_with_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    err = one_line_failure("--port", "0", "--probes", str(tmp_path), "--insecure",
                           "--verdict-log", str(tmp_path / "a-file" / "verdicts.db"))
    assert err.startswith(f"router_service: error: verdict log {tmp_path}/a-file/verdicts.db: "), err
    err = one_line_failure("--port", "0", "--probes", str(tmp_path), "--insecure",
                           "--verdict-log", "postgresql://user:secret@127.0.0.1:1/log")
    assert err.startswith("router_service: error: verdict log postgresql://user:***@127.0.0.1:1/log: "), err
    assert "secret" not in err
