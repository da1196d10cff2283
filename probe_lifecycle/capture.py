"""Capture a labelled dataset from a running engine.

    python -m probe_lifecycle.capture --engine HOST:PORT --input examples.jsonl \
        --out DATASET [--tensor-type residual_stream[,attn_out,...]] [--layers 2[,3]] \
        [--tokens prompt|generated|all] [--pooling last|mean|all] [--max-tokens N] \
        [--concurrency 4] [--shard-mb 64]

Every example is one Generate request (greedy, ignore_eos, so a generated
scope always yields max_tokens - 1 rows) whose extraction points stream their
records back in-band; no router is involved. The input is validated in full
before anything is captured. Examples are committed in input order, a few
requests in flight; running the same command again after an interruption
captures only the examples not yet committed.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from common.activations import from_batch
from common.capture_spec import TENSOR_TYPES, tensor_type_from_proto
from probe_lifecycle.cli import OneLineParser, fail
from probe_lifecycle.dataset import (
    POOLINGS, SCOPES, DatasetError, DatasetSpec, DatasetWriter, ExampleRows, feature_key,
)
from probe_lifecycle.examples import Example, InputError, check_examples, read_examples
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent_client import Activations, AsyncEngineClient, Finished, RpcError, Started, Tokens
from undercurrent_client.capture_file import CapturedRequest, LabelledExample
from undercurrent_client.connection import from_env

_FINISHED_OK = ("STOP", "LENGTH")
MODEL_INFO_TIMEOUT = 30


class CaptureError(RuntimeError):
    """One example could not be captured; names its line and id."""


class IncompleteCapture(CaptureError):
    """The engine finished a request without sending every selected row."""


ATTEMPTS = 3
"""Tries per example when the engine's rows are incomplete (seen rarely: the last
generated row missing); a dataset never holds an example with rows missing."""


def expected_positions(spec: DatasetSpec, prompt_tokens: int, generated_tokens: int) -> np.ndarray:
    """The positions the extraction points select for a finished request. The last
    sampled token is never fed back, so generated rows stop one short of the count."""
    end = prompt_tokens + max(generated_tokens - 1, 0)
    if spec.scope == "prompt":
        if spec.pooling == "last":
            return np.array([prompt_tokens - 1])
        return np.arange(prompt_tokens)
    return np.arange(prompt_tokens if spec.scope == "generated" else 0, end)


@dataclass
class CaptureResult:
    manifest: dict
    captured: int  # examples captured by this run
    skipped: int  # examples an earlier run had committed
    retried: list[str]  # why each incomplete attempt was run again


async def capture_example(engine: AsyncEngineClient, example: Example, spec: DatasetSpec,
                          keys: list[str], source: str,
                          retried: list[str] | None = None) -> ExampleRows:
    """Runs one example and returns its pooled rows, retrying an incomplete capture
    (each retry's reason is appended to `retried`)."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return await _capture_once(engine, example, spec, keys, source)
        except IncompleteCapture as err:
            if retried is not None:
                retried.append(str(err))
            if attempt == ATTEMPTS:
                raise CaptureError(f"{err} (in each of {ATTEMPTS} attempts)") from None
    raise AssertionError("unreachable")


async def _capture_once(engine: AsyncEngineClient, example: Example, spec: DatasetSpec,
                        keys: list[str], source: str) -> ExampleRows:
    where = f"{source}:{example.line} (id {example.id!r})"
    request = engine_pb.GenerateRequest(
        text=example.text,
        sampling=engine_pb.SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True),
        extraction_points=spec.points(),
    )
    parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {key: [] for key in keys}
    started, text, finished = None, [], None
    try:
        async for event in engine.generate(request):
            if isinstance(event, Started):
                started = event
            elif isinstance(event, Tokens):
                text.append(event.text)
            elif isinstance(event, Activations):
                for block in from_batch(event.batch):
                    key = feature_key(tensor_type_from_proto(block.tensor_type), block.layer)
                    if key not in parts:
                        raise CaptureError(f"{where}: the engine sent {key!r}, not asked for")
                    parts[key].append((block.token_positions, block.is_generated, block.rows))
            elif isinstance(event, Finished):
                finished = event
    except RpcError as err:
        raise CaptureError(f"{where}: the engine refused it: {err.code.name}: {err.details}") from None
    if started is None or finished is None:
        raise CaptureError(f"{where}: the stream ended without a "
                           f"{'started' if started is None else 'finished'} message")
    if finished.reason not in _FINISHED_OK:
        raise CaptureError(f"{where}: generation ended {finished.reason}: {finished.message}")
    run = CapturedRequest(started.request_id, example.text, started.prompt_tokens,
                          finished.generated_tokens, finished.reason, "".join(text),
                          LabelledExample(example.id, example.label, example.line))
    return _assemble(run, parts, spec, where)


def _assemble(request: CapturedRequest, parts: dict, spec: DatasetSpec, where: str) -> ExampleRows:
    """Orders each key's rows by position, checks every key saw the same positions, pools."""
    features, positions, generated = {}, None, None
    for key, chunks in parts.items():
        pos = np.concatenate([c[0] for c in chunks]) if chunks else np.zeros(0, np.int64)
        gen = np.concatenate([c[1] for c in chunks]) if chunks else np.zeros(0, bool)
        hidden = chunks[0][2].shape[1] if chunks else 0
        rows = np.concatenate([c[2] for c in chunks]) if chunks else np.zeros((0, hidden), np.float32)
        order = np.argsort(pos, kind="stable")
        pos, gen, rows = pos[order], gen[order], rows[order]
        if np.unique(pos).size != pos.size:
            raise CaptureError(f"{where}: {key}: a token position arrived twice")
        if positions is None:
            positions, generated = pos, gen
        elif not np.array_equal(pos, positions):
            raise CaptureError(f"{where}: {key}: positions differ from the other points'")
        features[key] = rows
    expected = expected_positions(spec, request.prompt_tokens, request.generated_tokens)
    if not np.array_equal(positions, expected):
        missing = sorted(set(expected.tolist()) - set(positions.tolist()))
        extra = sorted(set(positions.tolist()) - set(expected.tolist()))
        raise IncompleteCapture(
            f"{where}: the engine sent {positions.size} of {expected.size} selected rows "
            f"(missing positions {missing[:8]}, unexpected {extra[:8]})"
        )
    pooling = spec.pooling
    if positions.size and pooling != "all":
        pick = slice(-1, None)
        features = {
            key: rows.mean(axis=0, keepdims=True) if pooling == "mean" else rows[pick]
            for key, rows in features.items()
        }
        positions, generated = positions[pick], generated[pick]
    return ExampleRows(request, features, positions.astype(np.int64), generated.astype(bool))


async def run_capture(engine: str, input_path: str | Path, out: str | Path, spec: DatasetSpec,
                      concurrency: int = 4, shard_bytes: int = 64 << 20,
                      show_progress: bool = True, timeout: float = 300) -> CaptureResult:
    summary = check_examples(input_path)  # before any file is written
    connection = from_env(engine)
    async with AsyncEngineClient(connection, timeout=MODEL_INFO_TIMEOUT) as info:
        try:
            model = await info.model_info()
        except RpcError as err:
            raise CaptureError(f"--engine {engine}: {err.code.name}: {err.details}") from None
    async with AsyncEngineClient(connection, timeout=timeout) as client:
        spec.check(model)
        source = {"path": str(input_path), "sha256": summary.sha256, "examples": summary.examples,
                  "positives": summary.positives, "negatives": summary.negatives}
        writer = DatasetWriter.open(out, spec, model, source, shard_bytes)
        retried: list[str] = []
        try:
            skipped = len(writer.done)
            captured = await _capture_remaining(client, writer, input_path, spec, summary.examples,
                                                concurrency, show_progress, retried)
            manifest = writer.finish()
        finally:
            writer.close()
    return CaptureResult(manifest, captured, skipped, retried)


async def _capture_remaining(engine: AsyncEngineClient, writer: DatasetWriter,
                             input_path: str | Path, spec: DatasetSpec, total: int,
                             concurrency: int, show_progress: bool, retried: list[str]) -> int:
    """Captures the examples the writer has not committed, `concurrency` in flight,
    committing them in input order; returns how many it captured."""
    bar = tqdm(total=total, initial=len(writer.done), unit="req", disable=not show_progress,
               file=sys.stderr, dynamic_ncols=True)
    rows = nbytes = captured = 0
    pending: deque[asyncio.Task] = deque()

    def commit(result: ExampleRows) -> None:
        nonlocal rows, nbytes, captured
        writer.add(result)
        captured += 1
        rows += result.num_rows
        nbytes += result.nbytes
        bar.update(1)
        bar.set_postfix(rows=rows, MB=f"{nbytes / 1e6:.1f}", refresh=False)

    try:
        for example in read_examples(input_path):
            if example.id in writer.done:
                continue
            pending.append(asyncio.create_task(
                capture_example(engine, example, spec, writer.keys, str(input_path), retried)))
            if len(pending) >= concurrency:
                commit(await pending.popleft())
        while pending:
            commit(await pending.popleft())
    finally:
        for task in pending:
            task.cancel()
        # What completed in order is valid: keep it, so a resume does not redo it.
        try:
            writer.flush()
        finally:
            bar.close()
    return captured


def parse_args(argv: list[str] | None) -> tuple:
    parser = OneLineParser(prog="probe_lifecycle.capture", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True, help="engine address HOST:PORT")
    parser.add_argument("--input", required=True, help="labelled prompts, JSONL: text, label, id")
    parser.add_argument("--out", required=True, help="dataset directory (created, or resumed)")
    parser.add_argument("--tensor-type", default="residual_stream",
                        help=f"comma-separated, from {list(TENSOR_TYPES)}")
    parser.add_argument("--layers", default="", help="comma-separated decoder layer indexes")
    parser.add_argument("--tokens", choices=list(SCOPES), default="generated")
    parser.add_argument("--pooling", choices=list(POOLINGS), default="all")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="generated tokens per example (default 1 for --tokens prompt, else 16)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--shard-mb", type=float, default=64.0)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per request")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        layers = tuple(int(x) for x in args.layers.split(",") if x.strip())
    except ValueError:
        parser.error(f"--layers: {args.layers!r} is not a comma-separated list of integers")
    if args.concurrency < 1:
        parser.error(f"--concurrency: {args.concurrency} is less than 1")
    if args.shard_mb <= 0:
        parser.error(f"--shard-mb: {args.shard_mb} is not positive")
    max_tokens = args.max_tokens or (1 if args.tokens == "prompt" else 16)
    spec = DatasetSpec(
        tuple(t.strip() for t in args.tensor_type.split(",") if t.strip()), layers, args.tokens,
        args.pooling, max_tokens,
    )
    return args, spec


def main(argv: list[str] | None = None) -> int:
    args, spec = parse_args(argv)
    # SIGTERM stops like Ctrl-C: examples already complete are committed before exit.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        result = asyncio.run(run_capture(
            args.engine, args.input, args.out, spec, args.concurrency, int(args.shard_mb * 2**20),
            show_progress=not args.no_progress, timeout=args.timeout,
        ))
    except (InputError, DatasetError, CaptureError) as err:
        fail("probe_lifecycle.capture", str(err))
    except KeyboardInterrupt:
        fail("probe_lifecycle.capture", "interrupted; committed examples are kept, run the same "
             "command again to resume")
    m = result.manifest
    print(
        f"dataset {args.out}: {m['examples']} examples ({result.captured} captured now, "
        f"{result.skipped} resumed), {m['rows']} rows of {m['keys']} in {len(m['shards'])} shard(s)"
    )
    for reason in result.retried:
        print(f"retried after an incomplete capture: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
