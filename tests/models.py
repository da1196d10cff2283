"""Where the tests find the embedded models (`make models` creates them)."""

from pathlib import Path

from common.embedded_model import make

MODELS_DIR = Path(__file__).resolve().parent.parent / ".cache" / "models"
EMBEDDED_MODELS = {arch: make(arch, MODELS_DIR / arch) for arch in ("tiny-llama", "tiny-qwen3")}
