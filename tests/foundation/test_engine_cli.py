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
                            "--port", str(port), "--insecure")
    assert_one_line_error(result, "--port", f"127.0.0.1:{port}")


def test_limit_flags_must_be_positive():
    result = run_engine("--model", str(EMBEDDED_MODELS["tiny-llama"]), "--max-streams", "0")
    assert_one_line_error(result, "--max-streams must be > 0")


def test_limit_flags_and_their_defaults():
    from engine_service.__main__ import build_parser

    parser = build_parser()
    args = parser.parse_args(["--model", "m"])
    assert (args.max_message_bytes, args.max_streams, args.max_extraction_points, args.max_prompt_bytes,
            args.client_queue_bytes) == (64 * 1024 * 1024, 256, 64, 0, 32 * 1024 * 1024)
    args = parser.parse_args(["--model", "m", "--max-message-bytes", "1048576", "--max-streams", "2",
                              "--max-extraction-points", "3", "--max-prompt-bytes", "4096",
                              "--client-queue-bytes", "65536"])
    assert (args.max_message_bytes, args.max_streams, args.max_extraction_points, args.max_prompt_bytes,
            args.client_queue_bytes) == (1048576, 2, 3, 4096, 65536)
