"""Fixtures shared by every test folder; keep this small and general."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO / ".cache" / "models"

# vLLM on CPU: a small fixed KV cache and no model hub. Set before vLLM is imported.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_llama_path() -> str:
    return str(MODELS_DIR / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen3_path() -> str:
    return str(MODELS_DIR / "tiny-qwen3")
