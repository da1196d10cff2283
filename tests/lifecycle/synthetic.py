"""Datasets written through the real DatasetWriter from planted activations, for
tests of training and dataset handling that need no engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from probe_lifecycle.dataset import DatasetSpec, DatasetWriter, ExampleRows
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client.capture_file import CapturedRequest, LabelledExample

HIDDEN = 16
TOKENS = 5


def model_info(hidden: int = HIDDEN, name: str = "synthetic") -> types_pb.ModelInfo:
    return types_pb.ModelInfo(model=name, architecture="LlamaForCausalLM", num_layers=4,
                        hidden_size=hidden, dtype="float32", vocab_size=512,
                        tensor_types=[types_pb.TENSOR_TYPE_RESIDUAL_STREAM, types_pb.TENSOR_TYPE_ATTN_OUT])


def spec(pooling: str = "all", layers=(1, 2)) -> DatasetSpec:
    return DatasetSpec(("residual_stream",), tuple(layers), "generated", pooling, TOKENS + 1)


def example_rows(i: int, label: int, rng: np.random.Generator, layers=(1, 2),
                 shift: float = 1.5) -> ExampleRows:
    """Noise rows; a positive's rows are shifted along the first axis."""
    features = {}
    for layer in layers:
        rows = rng.normal(size=(TOKENS, HIDDEN)).astype(np.float32)
        rows[:, 0] += shift * label
        features[f"residual_stream.{layer}"] = rows
    request = CapturedRequest(f"req-{i}", f"prompt {i}", 10, TOKENS + 1, "LENGTH", f"text {i}",
                              LabelledExample(f"ex{i}", label, i + 1))
    return ExampleRows(request, features, np.arange(10, 10 + TOKENS, dtype=np.int64),
                       np.ones(TOKENS, bool))


def write_dataset(directory: Path, count: int = 80, seed: int = 0, complete: bool = True,
                  shard_bytes: int = 4000, **spec_args) -> Path:
    rng = np.random.default_rng(seed)
    source = {"path": "synthetic.jsonl", "sha256": "0" * 64, "examples": count,
              "positives": count // 2, "negatives": count - count // 2}
    the_spec = spec(**spec_args)
    writer = DatasetWriter.open(directory, the_spec, model_info(), source, shard_bytes)
    for i in range(count):
        writer.add(example_rows(i, i % 2, rng, layers=the_spec.layers))
    if complete:
        writer.finish()
    else:
        writer.flush()
    return directory
