"""Makes the embedded default models: tiny Llama and Qwen3 checkpoints with
random weights from a fixed seed and a byte-level BPE tokenizer, so vLLM and
transformers can load them from disk with no model hub.

Run: `python -m common.embedded_model --arch tiny-llama --out .cache/models/tiny-llama`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]

# head_dim 64: the CPU attention kernels refuse smaller heads.
ARCHITECTURES = {
    "tiny-llama": dict(
        config_class="LlamaConfig",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
    ),
    # One KV head: under TP=2 vLLM replicates it across ranks.
    "tiny-qwen3": dict(
        config_class="Qwen3Config",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    ),
    # The benchmark model (bench/overhead.py): about 97M parameters, big enough
    # that a step's compute, not Python, dominates, as in a real deployment.
    "bench-llama": dict(
        config_class="LlamaConfig",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        init_std=0.02,
    ),
}

# Text the tokenizer is trained on; deterministic, no download.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Undercurrent watches a language model from the inside while it serves.",
    "Activations flow through the residual stream, attention and MLP blocks.",
    "A probe is a small classifier that reads activations and returns a score.",
    "Tensor parallelism splits weight matrices; pipeline parallelism splits layers.",
    "Once upon a time there was a tiny model that generated random text.",
    "import numpy as np\nfor i in range(10):\n    print(i * 2)\n",
    "Hello, world! How are you today? I am fine, thank you.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )
    fast.save_pretrained(out)


def build_model(arch: str, out: Path) -> None:
    import torch
    import transformers

    spec = dict(ARCHITECTURES[arch])
    config_class = getattr(transformers, spec.pop("config_class"))
    init_std = spec.pop("init_std", 0.08)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    config = config_class(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
        **spec,
    )
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Wider than the default init so greedy decoding is not a constant token.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, init_std)
    model.save_pretrained(out, safe_serialization=True)


def make(arch: str, out: Path) -> Path:
    if arch not in ARCHITECTURES:
        raise SystemExit(f"error: unknown --arch {arch!r}; choose from {sorted(ARCHITECTURES)}")
    if (out / "config.json").exists():
        return out
    print(f"Making the embedded model {arch} in {out} ...", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    build_model(arch, out)
    (out / "undercurrent_model.json").write_text(json.dumps({"arch": arch, "seed": SEED}))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="tiny-llama", help=f"one of {sorted(ARCHITECTURES)}")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    make(args.arch, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
