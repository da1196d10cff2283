"""Bad command-line input ends the engine with one line naming the problem."""

import contextlib
import io
import socket
import subprocess
import sys
from unittest import mock

import pytest

from tests.models import EMBEDDED_MODELS


def run_engine(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine_service", *args],
        capture_output=True, text=True, timeout=timeout,
    )


def refuse(*args: str) -> subprocess.CompletedProcess:
    """The engine's main() on these flags in this process (vLLM's import is paid
    once, not per case): it must exit 2 before it starts anything."""
    from engine_service.__main__ import main

    stderr = io.StringIO()
    started = AssertionError(f"main({args}) went on to start the engine")
    with (contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exited,
          mock.patch("engine_service.service.app.run", side_effect=started)):
        main(list(args))
    return subprocess.CompletedProcess(args, exited.value.code, "", stderr.getvalue())


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in errors[0]


def test_missing_model_path():
    """As a process: the one line, exit 2 and no traceback reach the shell."""
    result = run_engine("--model", "/nonexistent/model-dir", "--port", "0")
    assert_one_line_error(result, "--model", "/nonexistent/model-dir", "does not exist")


def test_unknown_flag():
    result = refuse("--model", str(EMBEDDED_MODELS["tiny-llama"]), "--no-such-flag")
    assert_one_line_error(result, "unrecognized arguments: --no-such-flag")


def test_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_engine("--model", str(EMBEDDED_MODELS["tiny-llama"]), "--host", "127.0.0.1",
                            "--port", str(port), "--insecure")
    assert_one_line_error(result, "--port", f"127.0.0.1:{port}")


@pytest.mark.parametrize("flag", ["--max-streams", "--send-queue-bytes"])
def test_limit_flags_must_be_positive(flag):
    result = refuse("--model", str(EMBEDDED_MODELS["tiny-llama"]), flag, "0")
    assert_one_line_error(result, f"{flag} must be > 0")


def test_limit_flags_and_their_defaults():
    from engine_service.__main__ import build_parser

    parser = build_parser()
    args = parser.parse_args(["--model", "m"])
    assert (args.max_message_bytes, args.max_streams, args.max_extraction_points, args.max_prompt_bytes,
            args.client_queue_bytes, args.send_queue, args.send_queue_bytes) == (
        64 * 1024 * 1024, 256, 64, 0, 32 * 1024 * 1024, 256, 256 * 1024 * 1024)
    args = parser.parse_args(["--model", "m", "--max-message-bytes", "1048576", "--max-streams", "2",
                              "--max-extraction-points", "3", "--max-prompt-bytes", "4096",
                              "--client-queue-bytes", "65536", "--send-queue", "5",
                              "--send-queue-bytes", "4096"])
    assert (args.max_message_bytes, args.max_streams, args.max_extraction_points, args.max_prompt_bytes,
            args.client_queue_bytes, args.send_queue, args.send_queue_bytes) == (
        1048576, 2, 3, 4096, 65536, 5, 4096)


def test_the_send_queue_bounds_reach_the_router_link():
    from engine_service.__main__ import build_parser
    from engine_service.service.app import link_config

    args = build_parser().parse_args(["--model", "m", "--router", "127.0.0.1:1", "--send-queue", "5",
                                      "--send-queue-bytes", "4096"])
    config = link_config(args, None)
    assert (config.queue_max_batches, config.queue_max_bytes) == (5, 4096)


def test_the_router_timeouts_reach_the_router_link_and_are_checked():
    from engine_service.__main__ import build_parser
    from engine_service.service.app import link_config

    args = build_parser().parse_args(["--model", "m", "--router", "127.0.0.1:1"])
    config = link_config(args, None)
    assert (config.router_timeout_s, config.heartbeat_timeout_s) == (3.0, 6.0)
    args = build_parser().parse_args(["--model", "m", "--router", "127.0.0.1:1", "--router-timeout", "10",
                                      "--router-heartbeat-timeout", "30"])
    config = link_config(args, None)
    assert (config.router_timeout_s, config.heartbeat_timeout_s) == (10.0, 30.0)
    result = refuse("--model", str(EMBEDDED_MODELS["tiny-llama"]), "--router-heartbeat-timeout", "1")
    assert_one_line_error(result, "--router-heartbeat-timeout must exceed the 2 s between heartbeats")


def node_args(*flags: str):
    from argparse import Namespace

    values = dict(nnodes=1, node_rank=0, master_addr=None)
    for name, value in zip(flags[::2], flags[1::2]):
        key = name.removeprefix("--").replace("-", "_")
        values[key] = value if key == "master_addr" else int(value)
    return Namespace(**values)


@pytest.mark.parametrize("worker_node, flags, fragments", [
    (True, ("--nnodes", "1"), ("--nnodes 1", "2 or more")),
    (True, ("--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1"),
     ("--node-rank 0", "node 0 is the engine service", "--node-rank 1")),
    (True, ("--nnodes", "3", "--node-rank", "3", "--master-addr", "10.0.0.1"), ("--node-rank 3", "below --nnodes 3")),
    (True, ("--nnodes", "2", "--node-rank", "1"), ("--master-addr", "required with --nnodes 2")),
    (False, ("--nnodes", "3", "--node-rank", "2", "--master-addr", "10.0.0.1"),
     ("--node-rank 2", "engine service is node 0", "node 1 to 2", "engine_service.worker_node")),
    (False, ("--nnodes", "2"), ("--master-addr", "required with --nnodes 2")),
])
def test_inconsistent_node_flags_are_refused(worker_node, flags, fragments):
    from engine_service.nodes import NodeFlagsError, check_node_flags

    with pytest.raises(NodeFlagsError) as refused:
        check_node_flags(node_args(*flags), worker_node)
    for fragment in fragments:
        assert fragment in str(refused.value)


def test_consistent_node_flags_pass_and_one_node_needs_no_master_address():
    from engine_service.nodes import check_node_flags

    single = node_args()
    check_node_flags(single, worker_node=False)
    assert single.master_addr == "127.0.0.1"
    worker = node_args("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1")
    check_node_flags(worker, worker_node=True)
    assert worker.master_addr == "10.0.0.1"
    check_node_flags(node_args("--nnodes", "2", "--master-addr", "10.0.0.1"), worker_node=False)


def test_node_flags_on_the_command_lines():
    """Both commands parse the same flags and refuse what contradicts their node's role."""
    model = str(EMBEDDED_MODELS["tiny-llama"])
    result = refuse("--model", model, "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1")
    assert_one_line_error(result, "engine_service: error: --node-rank 1", "engine_service.worker_node")
    worker = subprocess.run(
        [sys.executable, "-m", "engine_service.worker_node", "--model", model, "--nnodes", "2",
         "--node-rank", "1"], capture_output=True, text=True, timeout=120)
    assert_one_line_error(worker, "engine_service.worker_node: error: --master-addr: required")


def test_node_timeout_must_not_be_negative():
    result = refuse("--model", str(EMBEDDED_MODELS["tiny-llama"]), "--node-timeout", "-1")
    assert_one_line_error(result, "--node-timeout must be >= 0")


def test_the_service_stays_where_it_started_unless_asked_to_keep_off_the_workers_cores():
    from engine_service.__main__ import build_parser

    parser = build_parser()
    assert parser.parse_args(["--model", "m"]).keep_off_worker_cores is False
    assert parser.parse_args(["--model", "m", "--keep-off-worker-cores"]).keep_off_worker_cores is True


def test_the_engine_core_wait_defaults_to_auto_and_refuses_others_by_name(capsys):
    from engine_service.__main__ import build_parser

    parser = build_parser()
    assert parser.parse_args(["--model", "m"]).engine_core_wait == "auto"
    assert parser.parse_args(["--model", "m", "--engine-core-wait", "spin"]).engine_core_wait == "spin"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--engine-core-wait", "nap"])
    assert "--engine-core-wait: invalid choice: 'nap'" in capsys.readouterr().err


def test_the_engine_core_nice_defaults_to_auto():
    from engine_service.__main__ import build_parser

    parser = build_parser()
    assert parser.parse_args(["--model", "m"]).engine_core_nice == "auto"
    assert parser.parse_args(["--model", "m", "--engine-core-nice", "-5"]).engine_core_nice == "-5"


@pytest.mark.parametrize("value, reason", [("high", "expected auto or an integer from -20 to 19"),
                                           ("-21", "engine core nice -21: expected auto")])
def test_a_bad_engine_core_nice_is_refused_by_name(value, reason):
    result = refuse("--model", str(EMBEDDED_MODELS["tiny-llama"]), f"--engine-core-nice={value}")
    assert_one_line_error(result, "--engine-core-nice", reason)
