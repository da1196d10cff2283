"""The Python client, the `undercurrent` command and the Node.js client against the
real engine and a real router: a probe built to fire at a known token (the oracle),
activations compared with a first capture, ProbeAdmin load, list and unload."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from google.protobuf.json_format import MessageToDict

from common.activations import Block, from_batch, to_batch
from common.probe_format.files import load_probe_path, write_probe
from probe_lifecycle.dataset import load_features
from tests.e2e import node_live
from tools import firing_probes, stack
from tools.dev_security import DevSecurity
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import engine_pb2_grpc as engine_pb_grpc
from undercurrent_client import (
    ActivationKey,
    AsyncEngineClient,
    AsyncProbeAdminClient,
    EngineClient,
    Finished,
    Generation,
    Probe,
    RpcError,
    Started,
    Connection,
    Tokens,
    capture_file,
    generate_request,
)

pytestmark = pytest.mark.vllm

PROMPTS = ["The quick brown fox", "Hello, world! How are", "A probe is a small"]
MAX_TOKENS = 48
LONG_RUN = 1000  # tokens: the longest request the engine's 1024-token context takes
CLI = [sys.executable, "-m", "undercurrent_client"]


def admin_connection(address: str) -> Connection:
    """Mutual TLS with the development client certificate and the admin token (routers require both)."""
    dev = DevSecurity.ensure()
    cert, key = dev.pem("client")
    return Connection(address, root_certificates=dev.ca, certificate_chain=cert, private_key=key,
                      token=dev.admin_token)


def greedy(prompt: str, rid: str, max_tokens: int = MAX_TOKENS, **fields) -> engine_pb.GenerateRequest:
    return generate_request(prompt, request_id=rid, max_tokens=max_tokens, temperature=0.0,
                            ignore_eos=True, **fields)


@pytest.fixture(scope="module")
async def router(engine_service, router_ports, tmp_path_factory):
    """One router for this module, on the engine's first router port."""
    service = stack.router(router_ports[0], tmp_path_factory.mktemp("client-probes")).start()
    try:
        await service.wait_health(want_serving=None, timeout=60)
        yield service
    finally:
        service.kill()


@pytest.fixture(scope="module")
async def baseline(engine_service) -> list[Generation]:
    """Greedy runs of each prompt with layer-3 residual rows, through the async client."""
    async with AsyncEngineClient(stack.engine_connection(engine_service.address), timeout=120) as engine:
        runs = await asyncio.gather(*[
            Generation.of_async(engine.generate(greedy(p, f"client-base-{i}",
                                                       points=[firing_probes.trace_point()])))
            for i, p in enumerate(PROMPTS)
        ])
    for run in runs:
        assert run.reason == "LENGTH" and len(run.token_ids) == MAX_TOKENS
    return runs


def trace_rows(run: Generation) -> dict[int, np.ndarray]:
    return {k.token_position: v for k, v in run.activations.arrays.items()
            if k.point == firing_probes.TRACE_POINT}


@pytest.fixture(scope="module")
async def firing_probe(baseline, router, engine_service, tmp_path_factory) -> firing_probes.FiringProbe:
    """Uploaded with the async admin client; the engine's catalog offers it before use."""
    rows = [trace_rows(run) for run in baseline]
    probe = firing_probes.probe_firing_at("client_fires", rows[0], rows[1:], min_index=4)
    local = tmp_path_factory.mktemp("local-probe") / probe.name
    write_probe(local, probe.manifest("abort"),
                {"weight": probe.weight, "bias": np.array([probe.bias], np.float32)})
    async with AsyncProbeAdminClient(admin_connection(router.address)) as admin:
        info = await admin.load(upload=local)
        assert (info.name, info.action) == (probe.name, types_pb.PROBE_ACTION_ABORT)
        assert probe.name in [p.name for p in await admin.list()]
    async with stack.channel(engine_service.address) as channel:
        await stack.wait_for_probe(engine_pb_grpc.EngineServiceStub(channel), probe.name)
    return probe


# -- Python client -------------------------------------------------------------


async def test_async_client_streams_typed_events_and_stops_at_the_probe(engine_service, baseline,
                                                                       firing_probe, router):
    async with AsyncEngineClient(stack.engine_connection(engine_service.address), timeout=120) as engine:
        events = [e async for e in engine.generate(greedy(
            PROMPTS[0], "client-gated", gate_tokens=True,
            probes=[Probe(firing_probe.name, failure_policy="fail_closed")]))]
    assert isinstance(events[0], Started) and events[0].request_id == "client-gated"
    assert isinstance(events[-1], Finished)
    assert not any(isinstance(e, (Started, Finished)) for e in events[1:-1])
    run = Generation.of(events)
    trigger = firing_probe.position - run.prompt_tokens
    assert run.reason == "PROBE_ABORT"
    verdict = run.finished.verdict
    assert (verdict.probe, verdict.token_position, verdict.router) == (
        firing_probe.name, firing_probe.position, router.address)
    assert verdict.score >= firing_probe.threshold
    # Gated: exactly the tokens before the trigger, as the baseline generated them.
    assert run.token_ids == baseline[0].token_ids[:trigger]
    assert run.finished.generated_tokens > trigger


async def test_blocking_client_scores_and_activations_match_the_first_capture(engine_service, baseline,
                                                                             firing_probe):
    """The blocking client runs in a thread (this event loop hosts no server, but the
    thread keeps the test's loop free anyway)."""

    def observe() -> tuple[types_pb.ModelInfo, Generation]:
        with EngineClient(stack.engine_connection(engine_service.address), timeout=120) as engine:
            request = greedy(PROMPTS[0], "client-observed", points=[firing_probes.trace_point()],
                             probes=[Probe(firing_probe.name, action="observe")])
            return engine.model_info(), Generation.of(engine.generate(request))

    info, run = await asyncio.to_thread(observe)
    assert (info.architecture, info.num_layers, info.hidden_size) == ("LlamaForCausalLM", 4, 128)
    assert run.reason == "LENGTH" and run.token_ids == baseline[0].token_ids
    rows, base_rows = trace_rows(run), trace_rows(baseline[0])
    assert sorted(rows) == sorted(base_rows) == list(
        range(run.prompt_tokens, run.prompt_tokens + MAX_TOKENS - 1))
    for position, row in rows.items():
        np.testing.assert_allclose(row, base_rows[position], rtol=1e-5, atol=1e-5)
    assert ActivationKey("client-observed", firing_probes.TRACE_POINT, firing_probes.LAYER, run.prompt_tokens) in (
        run.activations.arrays)
    scores = run.probe_scores(firing_probe.name)
    assert sorted(scores) == sorted(rows)
    for position, score in scores.items():
        assert score == pytest.approx(firing_probe.score(base_rows[position]), rel=1e-4, abs=1e-4)
    assert scores[firing_probe.position] >= firing_probe.threshold


async def test_abort_by_id_and_errors_name_status_and_field(engine_service):
    async with AsyncEngineClient(stack.engine_connection(engine_service.address), timeout=120) as engine:

        async def long_run(request_id: str) -> Generation:
            run = Generation()
            async for event in engine.generate(greedy("a b c", request_id, max_tokens=LONG_RUN)):
                run.add(event)
            return run

        request_id = "client-abort"
        with stack.vllm_paused(engine_service):  # so the request still runs when its abort comes
            task = asyncio.create_task(long_run(request_id))
            aborted = False
            while not aborted and not task.done():  # from the request's start until the engine has it
                aborted = await engine.abort(request_id)
        run = await task
        assert aborted, run.finished
        assert run.reason == "CLIENT_ABORT" and len(run.token_ids) < LONG_RUN
        assert await engine.abort(request_id) is False

        with pytest.raises(RpcError) as unknown:
            await Generation.of_async(engine.generate(greedy("x", "", probes=["no_such_probe"])))
        assert unknown.value.code.name == "NOT_FOUND" and "probes[0].probe" in unknown.value.details

    # Leaving a blocking stream early cancels it, which aborts the request in vLLM.
    def leave_early() -> bool:
        with EngineClient(stack.engine_connection(engine_service.address), timeout=120) as engine:
            stream = engine.generate(greedy("d e f", "client-leave", max_tokens=LONG_RUN))
            for event in stream:
                if isinstance(event, Tokens):
                    break
            stream.close()
            for _ in range(100):
                if not engine.abort("client-leave"):
                    return True
                threading.Event().wait(0.1)
        return False

    assert await asyncio.to_thread(leave_early)


# -- the undercurrent command ----------------------------------------------------


async def cli(*args: str, timeout: float = 180) -> tuple[int, str, str]:
    """The command with the development CA and the `demo` client token (the engine runs with TLS)."""
    dev = DevSecurity.ensure()
    process = await asyncio.create_subprocess_exec(
        *CLI, *args, "--tls-root-cert", str(dev.ca),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "UNDERCURRENT_TOKEN": dev.client_token})
    out, err = await asyncio.wait_for(process.communicate(), timeout)
    return process.returncode, out.decode(), err.decode()


async def test_cli_generate_shows_scores_live_then_the_verdict(engine_service, baseline, firing_probe):
    engine = ["--engine", engine_service.address, "--temperature", "0", "--ignore-eos"]
    code, out, err = await cli("generate", PROMPTS[0], *engine, "--max-tokens", "8",
                               "--probe", firing_probe.name, "--action", "observe")
    assert code == 0, err
    prompt_tokens = baseline[0].prompt_tokens
    assert err.splitlines()[0].endswith(f": {prompt_tokens} prompt tokens; probe scores as "
                                        f"[probe] token:score (generated tokens from 0, prompt "
                                        f"tokens as pN)")
    score_lines = [line for line in out.splitlines() if line.startswith(f"  [{firing_probe.name}] ")]
    shown = [item.split(":") for line in score_lines for item in line.split()[1:]]
    # Generated tokens 0..6 have rows (the last sampled token is never fed back).
    assert [int(index) for index, _ in shown] == list(range(7))
    base_rows = trace_rows(baseline[0])
    for index, score in shown:
        assert float(score) == pytest.approx(
            firing_probe.score(base_rows[prompt_tokens + int(index)]), rel=1e-3, abs=1e-3)
    assert out.splitlines()[-1] == "finished: LENGTH, 8 tokens generated"

    code, out, err = await cli("generate", PROMPTS[0], *engine, "--max-tokens", str(MAX_TOKENS),
                               "--probe", firing_probe.name, "--gate", "--failure-policy", "fail_closed")
    assert code == 0, err
    trigger = firing_probe.position - prompt_tokens
    *text, finished, verdict = out.splitlines()
    assert finished.startswith("finished: PROBE_ABORT, ")
    assert verdict.startswith(f"verdict: probe {firing_probe.name} score ")
    assert f" at token {trigger} (router 127.0.0.1:" in verdict
    assert "\n".join(text) == baseline[0].text[: len("\n".join(text))] and text

    code, out, err = await cli("generate", "hi", "--engine", engine_service.address,
                               "--probe", "no_such_probe")
    assert (code, out) == (1, "")
    assert err.startswith("undercurrent: error: Generate failed with NOT_FOUND: probes[0].probe")
    assert err.count("\n") == 1


async def test_cli_capture_writes_the_documented_safetensors(engine_service, baseline, tmp_path):
    out_file = tmp_path / "capture.safetensors"
    code, out, err = await cli(
        "capture", PROMPTS[0], PROMPTS[1], "--engine", engine_service.address,
        "--point", f"residual_stream:{firing_probes.LAYER}", "--point", "mlp_out:0,2", "--tokens", "generated",
        "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--out", str(out_file))
    assert code == 0, err
    progress = [line.rsplit("\r", 1)[-1] for line in err.split("\n") if line]
    assert [line.split(":")[0][:5] for line in progress] == ["[1/2]", "[2/2]"]
    assert all(line.endswith(": 6 tokens, 15 rows, LENGTH") for line in progress), progress
    assert out.splitlines()[0] == f"wrote {out_file}: 2 requests, 30 rows in 3 (point, layer) groups"
    capture = capture_file.read(out_file)
    residual = f"residual_stream:{firing_probes.LAYER}"
    assert capture.groups == sorted([(residual, firing_probes.LAYER), ("mlp_out:0,2", 0), ("mlp_out:0,2", 2)])
    assert out.splitlines()[1:] == [f"  {point}/{layer}/rows  [10, 128]" for point, layer in capture.groups]
    rows = capture.group(residual, firing_probes.LAYER)
    assert rows.rows.shape == (10, 128)
    assert rows.request_index.tolist() == [0] * 5 + [1] * 5
    assert rows.is_generated.tolist() == [True] * 10
    prompt_tokens = [r.prompt_tokens for r in capture.requests]
    assert prompt_tokens == [baseline[0].prompt_tokens, baseline[1].prompt_tokens]
    assert rows.positions.tolist() == (
        list(range(prompt_tokens[0], prompt_tokens[0] + 5)) + list(range(prompt_tokens[1], prompt_tokens[1] + 5)))
    base_rows = trace_rows(baseline[0])
    for i, position in enumerate(rows.positions[:5].tolist()):
        np.testing.assert_allclose(rows.rows[i], base_rows[position], rtol=1e-5, atol=1e-5)
    assert [r.prompt for r in capture.requests] == PROMPTS[:2]
    assert all(r.finish_reason == "LENGTH" and r.generated_tokens == 6 for r in capture.requests)
    assert capture.model["hidden_size"] == 128
    assert capture.points[0] == capture_file.Point(residual, "residual_stream", (firing_probes.LAYER,),
                                                   {"scope": "generated"}, "all", "float32")


async def test_cli_captures_of_two_prompt_sets_import_as_a_dataset_and_train(engine_service, tmp_path):
    """`undercurrent capture` of a positive and a negative prompt set, then `probe_lifecycle
    import` and `train` on the files as written."""
    sets = {"pos": ["zanzibar zanzibar river", "the zanzibar stone", "a zanzibar and zanzibar"],
            "neg": ["a quiet river", "the old stone", "river and stone"]}
    for name, prompts in sets.items():
        code, _, err = await cli("capture", *prompts, "--engine", engine_service.address,
                                 "--point", "residual_stream:2", "--point", "final_norm",
                                 "--tokens", "generated", "--max-tokens", "4", "--temperature", "0",
                                 "--ignore-eos", "--out", str(tmp_path / f"{name}.safetensors"))
        assert code == 0, err
    lifecycle = [sys.executable, "-m", "probe_lifecycle"]
    imported = subprocess.run(
        [*lifecycle, "import", "--positive", str(tmp_path / "pos.safetensors"),
         "--negative", str(tmp_path / "neg.safetensors"), "--out", str(tmp_path / "ds")],
        capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout == (f"dataset {tmp_path / 'ds'}: 6 examples (6 imported now; 3 positive, "
                               "3 negative), 18 rows of ['residual_stream.2', 'final_norm.4'] in 1 shard(s)\n")
    _, features = load_features(tmp_path / "ds", "final_norm.4")
    captured = capture_file.read(tmp_path / "pos.safetensors")
    assert features.ids[:3] == [r.request_id for r in captured.requests]
    np.testing.assert_array_equal(features.rows[:9], captured.group("final_norm", 4).rows)
    trained = subprocess.run(
        [*lifecycle, "train", "--dataset", str(tmp_path / "ds"), "--out", str(tmp_path / "probe"),
         "--name", "imported", "--tensor-type", "residual_stream"],
        capture_output=True, text=True, timeout=120)
    assert trained.returncode == 0, trained.stderr
    assert trained.stdout.startswith("probe imported (logistic) on residual_stream.2: 4 train / 2 held-out")
    assert load_probe_path(tmp_path / "probe").manifest.layers == (2,)


async def test_cli_model_info(engine_service):
    code, out, err = await cli("model-info", "--engine", engine_service.address)
    assert code == 0, err
    fields = {line[:14].strip(): line[14:] for line in out.splitlines()}
    assert {k: fields[k] for k in ("architecture", "layers", "hidden size", "dtype", "topology",
                                   "tensor types", "rank 0")} == {
        "architecture": "LlamaForCausalLM", "layers": "4", "hidden size": "128", "dtype": "float32",
        "topology": "TP=1 PP=1", "tensor types": "residual_stream, attn_out, mlp_out, final_norm",
        "rank 0": "tp 0 pp 0 layers [0, 4) + final norm"}


# -- the Node.js client ------------------------------------------------------------


async def test_node_client_against_the_live_services(engine_service, router, baseline, firing_probe,
                                                     tmp_path):
    prompt_point = types_pb.ExtractionPoint(
        name="last_prompt", tensor_type=types_pb.TENSOR_TYPE_MLP_OUT, layers=[0, 2],
        tokens=types_pb.TokenSelector(scope=types_pb.TokenSelector.SCOPE_PROMPT, indexes=[-1]), stream_to_client=True)
    request = greedy(PROMPTS[1], "py-capture", max_tokens=6, points=[firing_probes.trace_point(), prompt_point])
    async with AsyncEngineClient(stack.engine_connection(engine_service.address), timeout=120) as engine:
        events = [e async for e in engine.generate(request)]
    run = Generation.of(events)
    assert run.reason == "LENGTH"
    batches = [e.batch for e in events if hasattr(e, "batch")]
    rows = [row for batch in batches for row in node_live.row_dicts(batch)]
    assert len(rows) == 5 + 2  # 5 fed-back generated tokens at layer 3, the last prompt token at 0 and 2
    blocks = [b for batch in batches for b in from_batch(batch)]
    encoded = []
    for dtype in ("float32", "float16", "bfloat16"):
        batch = to_batch([Block(b.point, b.tensor_type, b.layer, b.rows, b.request_ids, b.token_positions,
                                b.is_generated, dtype) for b in blocks])
        response = engine_pb.GenerateResponse(activations=batch).SerializeToString()
        encoded.append({"dtype": dtype, "response": base64.b64encode(response).decode(),
                        "rows": node_live.row_dicts(batch)})
    capture_request = MessageToDict(request)
    del capture_request["requestId"]
    fixture = {
        "abort": {"probe": {"name": firing_probe.name, "position": firing_probe.position,
                            "threshold": firing_probe.threshold},
                  "prompt": PROMPTS[0], "maxTokens": MAX_TOKENS, "baselineTokens": baseline[0].token_ids},
        "capture": {"request": capture_request, "rows": rows},
        "encoded": encoded,
        "admin": {"name": "node_norm", "manifestJson": json.dumps({
            "name": "node_norm", "version": "1", "kind": "norm", "tensor_type": "residual_stream",
            "layers": [3], "hidden_size": 128, "dtype": "float32", "threshold": 1e9, "action": "observe"})},
    }
    summary, output = await node_live.run(fixture, tmp_path, engine_service.address, router.address)
    assert summary == {"pass": "10", "fail": "0", "skipped": "0"}, output
