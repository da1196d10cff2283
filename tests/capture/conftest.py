"""Real vLLM engines with capture, shared across the capture tests (and stopped
after them, so later packages run on a quiet machine): start-up
costs about 35 s per engine on CPU, so each configuration starts once."""

import pytest

from tests.capture.oracle import TransformersOracle
from tools.capture_engines import capture_engine

# The smallest block the CPU kernels take (a multiple of 32), so prompts of a few
# dozen tokens fill whole blocks (prefix-cache hits), and a small token budget per
# step so longer prompts are chunked. 64 blocks keep each worker's KV cache tiny
# (several engines share this machine's memory with other test runs).
SMALL_STEPS = dict(block_size=32, max_num_batched_tokens=32, num_gpu_blocks_override=64)


@pytest.fixture(scope="package")
async def llama_engine(tiny_llama_path):
    async with capture_engine(tiny_llama_path, **SMALL_STEPS) as engine_and_controller:
        yield engine_and_controller


@pytest.fixture(scope="package")
async def qwen3_engine(tiny_qwen3_path):
    async with capture_engine(tiny_qwen3_path, **SMALL_STEPS) as engine_and_controller:
        yield engine_and_controller


# Positions past its first unsettled one that the held engine's scheduler lets a
# bounded request compute (--max-tokens-ahead).
HELD_AHEAD = 1


@pytest.fixture(scope="package")
async def held_llama_engine(tiny_llama_path):
    """(engine, controller, allowances): a one-worker engine whose scheduler holds
    a bounded request HELD_AHEAD positions past its first unsettled one, as
    --max-tokens-ahead runs it, and the publisher of its allowances."""
    from engine_service.engine_core.tokens_ahead import AllowancePublisher

    allowances = AllowancePublisher(HELD_AHEAD)
    async with capture_engine(tiny_llama_path, allowances=allowances, **SMALL_STEPS) as (engine, controller):
        yield engine, controller, allowances
    allowances.close()


@pytest.fixture(scope="package")
def llama_oracle(tiny_llama_path):
    return TransformersOracle(tiny_llama_path)


@pytest.fixture(scope="package")
def qwen3_oracle(tiny_qwen3_path):
    return TransformersOracle(tiny_qwen3_path)


@pytest.fixture(params=["llama", "qwen3"])
def engine_and_oracle(request):
    """(engine, controller, oracle) for each verified architecture."""
    engine, controller = request.getfixturevalue(f"{request.param}_engine")
    return engine, controller, request.getfixturevalue(f"{request.param}_oracle")
