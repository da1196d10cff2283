"""The probe lifecycle on a running engine and router, as `make run` shows it.

Builds a labelled marker set (prompts with a marker word against prompts
without), captures the residual stream of a middle layer for it, trains a
logistic probe, loads it into the router live (plus an observe-only shadow
copy whose scores stream to the console), then sends a mix of held-out and
fresh prompts: flagged ones end PROBE_ABORT with the verdict, others finish.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

from common.enum_names import short_name
from probe_lifecycle import marker_set
from probe_lifecycle.capture import run_capture
from probe_lifecycle.dataset import DatasetSpec
from probe_lifecycle.deploy import deploy
from probe_lifecycle.live import generate_with_probe
from probe_lifecycle.train import TrainOptions, report, train_probe
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client import AsyncEngineClient, Event, Generation, ProbeScores
from undercurrent_client.connection import from_env

PROBE = "marker"
SHADOW = "marker_scores"
MAX_TOKENS = 8


async def lifecycle_demo(engine: str, routers: str, work_dir: Path, examples: int = 400,
                         shown: int = 8) -> None:
    async with AsyncEngineClient(from_env(engine), timeout=30) as client:
        model = await client.model_info()
    layer = model.num_layers // 2
    work_dir.mkdir(parents=True, exist_ok=True)
    input_path = marker_set.write_examples(
        work_dir / "marker.jsonl", marker_set.marker_examples(examples, seed=2, repeats=3))
    print(f"\n== 1. labelled set: {input_path} ({examples} prompts; label 1 = contains "
          f"{marker_set.MARKER!r})", flush=True)

    dataset = work_dir / "dataset"
    shutil.rmtree(dataset, ignore_errors=True)
    spec = DatasetSpec(("residual_stream",), (layer,), "generated", "all", MAX_TOKENS)
    print(f"== 2. capture: residual_stream layer {layer}, every generated token, "
          f"{MAX_TOKENS} tokens per prompt", flush=True)
    result = await run_capture(engine, input_path, dataset, spec, concurrency=4)
    print(f"dataset {dataset}: {result.manifest['examples']} examples, {result.manifest['rows']} rows",
          flush=True)

    probe_dir = work_dir / "probe"
    print("== 3. train: logistic regression, split by prompt, threshold at 5% held-out FPR",
          flush=True)
    trained = train_probe(dataset, probe_dir, TrainOptions(name=PROBE, c=0.05, target_fpr=0.05),
                          engine_model=model, force=True)
    print(report(trained), flush=True)

    print(f"== 4. deploy to router(s) {routers} without a restart", flush=True)
    for name, action in ((PROBE, None), (SHADOW, "observe")):
        for item in await deploy(probe_dir, routers, engine, name=name, action=action):
            print(f"loaded {item.probe.name} ({short_name(types_pb.ProbeAction, item.probe.action).lower()}, "
                  f"threshold {item.probe.threshold:.4g}) on {item.address}", flush=True)

    held_out = set(trained.provenance["training"]["held_out_ids"])
    rows = [json.loads(line) for line in input_path.read_text().splitlines()]
    held = [r for r in rows if r["id"] in held_out]
    mix = [r for r in held if r["label"] == 1][: shown // 2] + [
        r for r in held if r["label"] == 0][: shown // 2]
    mix.sort(key=lambda r: r["id"])
    mix += marker_set.marker_examples(2, seed=99, repeats=3, id_prefix="fresh")  # never captured
    print(f"== 5. generate with {PROBE!r} bound (abort) and {SHADOW!r} (observe: live scores)",
          flush=True)
    async with AsyncEngineClient(from_env(engine), timeout=120) as client:
        right = 0
        for row in mix:
            outcome = await _show(client, row)
            if (outcome.reason == "PROBE_ABORT") == bool(row["label"]):
                right += 1
            elif row["label"]:
                print("   (missed: a positive the probe let through)", flush=True)
            else:
                print("   (false positive: a negative the probe stopped)", flush=True)
        print(f"== {right} of {len(mix)} requests ended as their label says", flush=True)


async def _show(engine: AsyncEngineClient, row: dict) -> Generation:
    print(f"-- [{row['id']}, label {row['label']}] {row['text']!r}\n   scores:", end="", flush=True)

    def on_event(event: Event) -> None:
        if isinstance(event, ProbeScores):
            for score in event.scores:
                print(f" {score:.3f}", end="", flush=True)

    outcome = await generate_with_probe(engine, row["text"], [PROBE, SHADOW], MAX_TOKENS, on_event)
    done = outcome.finished
    print(f"\n   -> {outcome.reason} after {done.generated_tokens} token(s)", flush=True)
    if done.verdict is not None:
        print(f"   verdict: {done.verdict.reason} (router {done.verdict.router})", flush=True)
    return outcome


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True)
    parser.add_argument("--routers", required=True)
    parser.add_argument("--work-dir", default=".cache/lifecycle")
    args = parser.parse_args(argv)
    asyncio.run(lifecycle_demo(args.engine, args.routers, Path(args.work_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
