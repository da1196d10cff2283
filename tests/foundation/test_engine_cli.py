"""Bad command-line input ends the engine with one line naming the problem."""

import socket
import subprocess
import sys

import pytest

from tests.models import EMBEDDED_MODELS


def run_engine(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine_service", *args],
        capture_output=True, text=True, timeout=timeout,
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in errors[0]


def test_missing_model_path():
    result = run_engine("--model", "/nonexistent/model-dir", "--port", "0")
    assert_one_line_error(result, "--model", "/nonexistent/model-dir", "does not exist")


def test_unknown_flag():
    result = run_engine("--model", str(EMBEDDED_MODELS["tiny-llama"]), "--no-such-flag")
    assert_one_line_error(result, "unrecognized arguments: --no-such-flag")


def test_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_engine("--model", str(EMBEDDED_MODELS["tiny-llama"]), "--host", "127.0.0.1",
                            "--port", str(port))
    assert_one_line_error(result, "--port", f"127.0.0.1:{port}")
