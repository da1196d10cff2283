"""The probe lifecycle on the embedded model: capture a labelled set from the
engine process, train, deploy to two router processes live, watch it abort.

Stated bounds (marker set, residual stream of layer 2, 8 tokens per prompt,
logistic probe with its threshold at 5% held-out FPR): held-out AUROC >= 0.95;
live, >= 90% of held-out positives end PROBE_ABORT and <= 10% of held-out
negatives do; and every example whose offline score is not within 1e-3 of the
threshold ends live exactly as the offline score says.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from probe_lifecycle import marker_set
from probe_lifecycle.capture import run_capture
from probe_lifecycle.dataset import MANIFEST, PROGRESS, DatasetSpec, load_features, read_manifest
from probe_lifecycle.deploy import DeployError, deploy
from probe_lifecycle.live import generate_with_probe
from probe_lifecycle.train import TrainOptions, train_probe
from probe_lifecycle.training import example_scores
from common.probe_format.files import load_probe_path
from tests.lifecycle import synthetic
from tools import stack
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc
from undercurrent_client import AsyncEngineClient
from undercurrent_client.connection import from_env

pytestmark = pytest.mark.vllm

LAYER = 2
MAX_TOKENS = 8
SPEC = DatasetSpec(("residual_stream",), (LAYER,), "generated", "all", MAX_TOKENS)


def capture_cli(engine: str, input_path, out, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "probe_lifecycle.capture", "--engine", engine, "--input",
         str(input_path), "--out", str(out), "--layers", str(LAYER), "--tokens", "generated",
         "--max-tokens", str(MAX_TOKENS), "--no-progress", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


async def test_a_trained_probe_deployed_live_aborts_held_out_positives(
        engine_service, engine, start_router, router_ports, tmp_path):
    input_path = marker_set.write_examples(
        tmp_path / "marker.jsonl", marker_set.marker_examples(240, seed=2, repeats=3))
    captured = await run_capture(engine_service.address, input_path, tmp_path / "ds", SPEC,
                                 concurrency=4, show_progress=False)
    assert (captured.manifest["examples"], captured.manifest["rows"]) == (240, 240 * (MAX_TOKENS - 1))
    model = (await engine.GetModelInfo(engine_pb.GetModelInfoRequest())).model
    assert captured.manifest["model"]["hidden_size"] == model.hidden_size == 128

    trained = train_probe(tmp_path / "ds", tmp_path / "probe",
                          TrainOptions(name="marker", c=0.05, target_fpr=0.05), engine_model=model)
    held = trained.held_out
    assert held.auroc >= 0.95, held
    assert held.fpr <= 0.05

    routers = [await start_router(0), await start_router(1)]
    targets = ",".join(r.address for r in routers)
    deployed = await deploy(tmp_path / "probe", targets, engine_service.address)
    assert sorted(d.address for d in deployed) == sorted(r.address for r in routers)
    for router in routers:
        async with stack.channel(router.address) as channel:
            listed = await admin_pb_grpc.ProbeAdminServiceStub(channel).ListProbes(admin_pb.ListProbesRequest())
        assert [(p.name, p.threshold) for p in listed.probes] == [("marker", held.threshold)]

    # Offline scores of the held-out prompts, computed with the router's probe code.
    held_ids = trained.provenance["training"]["held_out_ids"]
    _, features = load_features(tmp_path / "ds", "residual_stream.2")
    index = np.array([features.ids.index(i) for i in held_ids])
    offline = example_scores(load_probe_path(tmp_path / "probe"), features, index)
    texts = {e["id"]: e for e in map(json.loads, input_path.read_text().splitlines())}

    limit = asyncio.Semaphore(4)

    async def live(client: AsyncEngineClient, example_id: str):
        async with limit:
            return await generate_with_probe(client, texts[example_id]["text"], "marker", MAX_TOKENS)

    async with AsyncEngineClient(from_env(engine_service.address), timeout=120) as client:
        outcomes = await asyncio.gather(*(live(client, i) for i in held_ids))
    labels = np.array([texts[i]["label"] for i in held_ids])
    aborted = np.array([o.reason == "PROBE_ABORT" for o in outcomes])
    assert {o.reason for o in outcomes} <= {"PROBE_ABORT", "LENGTH"}
    assert aborted[labels == 1].mean() >= 0.9, aborted[labels == 1].mean()
    assert aborted[labels == 0].mean() <= 0.1, aborted[labels == 0].mean()
    print(f"held-out AUROC {held.auroc:.3f}, offline TPR {held.tpr:.3f} FPR {held.fpr:.3f}; live: "
          f"{aborted[labels == 1].mean():.3f} of {int((labels == 1).sum())} positives and "
          f"{aborted[labels == 0].mean():.3f} of {int((labels == 0).sum())} negatives aborted")
    clear = np.abs(offline - held.threshold) > 1e-3
    np.testing.assert_array_equal(aborted[clear], (offline >= held.threshold)[clear])
    for outcome in outcomes:
        if outcome.reason == "PROBE_ABORT":
            verdict = outcome.finished.verdict
            assert verdict.probe == "marker" and verdict.score >= held.threshold
            assert verdict.router in targets.split(",")


async def test_a_probe_of_another_hidden_size_is_refused_and_loads_nowhere(
        engine_service, start_router, tmp_path):
    synthetic.write_dataset(tmp_path / "ds", count=20)  # hidden_size 16; the engine's is 128
    train_probe(tmp_path / "ds", tmp_path / "probe", TrainOptions(name="small", layer=1))
    router = await start_router(0)
    with pytest.raises(DeployError) as refused:
        await deploy(tmp_path / "probe", router.address, engine_service.address)
    assert "hidden_size 16 does not match the model's hidden_size 128" in str(refused.value)
    result = subprocess.run(
        [sys.executable, "-m", "probe_lifecycle.deploy", "--probe", str(tmp_path / "probe"),
         "--routers", router.address, "--engine", engine_service.address],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("probe_lifecycle.deploy: error: --probe ")
    assert "hidden_size 16 does not match" in result.stderr and "Traceback" not in result.stderr
    async with stack.channel(router.address) as channel:
        listed = await admin_pb_grpc.ProbeAdminServiceStub(channel).ListProbes(admin_pb.ListProbesRequest())
    assert list(listed.probes) == []


@pytest.mark.parametrize("bad_line, extra, message", [
    ('{"text": "river stone", "label": 1', (), "marker.jsonl:3: not valid JSON"),
    ('{"text": "river stone"}', (), "marker.jsonl:3: label: missing"),
    ('{"text": "river stone", "label": 0}', ("--layers", "9"),
     "--layers: 9 is out of range for a model with num_layers 4"),
])
def test_bad_capture_input_is_refused_before_anything_is_written(
        engine_service, tmp_path, bad_line, extra, message):
    rows = [json.dumps(e) for e in marker_set.marker_examples(2, seed=5)]
    input_path = tmp_path / "marker.jsonl"
    input_path.write_text("\n".join([*rows, bad_line]) + "\n")
    process = capture_cli(engine_service.address, input_path, tmp_path / "ds", *extra)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2, stderr
    assert message in stderr and "Traceback" not in stderr
    assert not (tmp_path / "ds").exists()


async def test_an_interrupted_capture_resumes_to_the_same_dataset(engine_service, tmp_path):
    input_path = marker_set.write_examples(
        tmp_path / "marker.jsonl", marker_set.marker_examples(90, seed=3))
    shard = ("--shard-mb", "0.01")  # ~3 examples a shard
    whole = capture_cli(engine_service.address, input_path, tmp_path / "whole", *shard)
    assert whole.wait(timeout=300) == 0, whole.stderr.read()

    cut = capture_cli(engine_service.address, input_path, tmp_path / "cut", "--concurrency", "1",
                      *shard)
    log = tmp_path / "cut" / PROGRESS
    deadline = time.monotonic() + 120
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert cut.poll() is None and time.monotonic() < deadline, "capture ended before the kill"
        await asyncio.sleep(0.02)
    os.kill(cut.pid, signal.SIGKILL)
    cut.wait(timeout=30)
    interrupted = read_manifest(tmp_path / "cut")
    assert interrupted["complete"] is False
    committed = sum(len(json.loads(line)["ids"]) for line in log.read_text().splitlines())
    assert 0 < committed < 90

    resumed = capture_cli(engine_service.address, input_path, tmp_path / "cut", *shard)
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    assert f"({90 - committed} captured now, {committed} resumed)" in stdout

    _, a = load_features(tmp_path / "whole", "residual_stream.2")
    _, b = load_features(tmp_path / "cut", "residual_stream.2")
    assert read_manifest(tmp_path / "cut")["complete"] and a.ids == b.ids  # same examples, same order
    assert a.labels.tolist() == b.labels.tolist()
    np.testing.assert_array_equal(a.example, b.example)
    np.testing.assert_array_equal(a.position, b.position)
    np.testing.assert_allclose(a.rows, b.rows, rtol=0, atol=1e-5)
    assert json.loads((tmp_path / "cut" / MANIFEST).read_text())["rows"] == 90 * (MAX_TOKENS - 1)


def test_a_prompt_the_engine_refuses_stops_the_capture_marked_partial(engine_service, tmp_path):
    rows = [json.dumps(e) for e in marker_set.marker_examples(4, seed=6)]
    too_long = json.dumps({"text": "river " * 1100, "label": 1, "id": "long"})
    input_path = tmp_path / "marker.jsonl"
    input_path.write_text("\n".join([*rows, too_long]) + "\n")
    process = capture_cli(engine_service.address, input_path, tmp_path / "ds", "--concurrency", "1")
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2, stderr
    assert "marker.jsonl:5 (id 'long'): the engine refused it: INVALID_ARGUMENT" in stderr
    manifest = read_manifest(tmp_path / "ds")
    assert manifest["complete"] is False  # marked partial; training refuses it
    logged = [json.loads(line)["ids"] for line in (tmp_path / "ds" / PROGRESS).read_text().splitlines()]
    assert sum(logged, []) == [f"ex{i:05d}" for i in range(4)]  # what finished before it is kept
