"""vLLM serves the embedded model exactly as transformers computes it.

Float32 on CPU: prompt log-probabilities agree to 1e-4 absolute (log-softmax
over 512 logits; measured differences are ~1e-6).
"""

import numpy as np
import pytest

from tests.models import EMBEDDED_MODELS

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world!",
    "A probe is a small classifier",
]
TOLERANCE = 1e-4

pytestmark = pytest.mark.vllm


def test_vllm_prompt_logprobs_match_transformers():
    import torch
    import transformers
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = str(EMBEDDED_MODELS["tiny-llama"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    llm = LLM(model=model_dir, enforce_eager=True, dtype="float32", max_model_len=256,
              enable_prefix_caching=False)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids in prompts],
        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
    )
    del llm  # stops the engine's worker processes
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    worst = 0.0
    for ids, output in zip(prompts, outputs):
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0]
        expected = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        served = output.prompt_logprobs
        assert served[0] is None and len(served) == len(ids)
        got = np.array([served[i][ids[i]].logprob for i in range(1, len(ids))])
        diff = np.abs(got - expected.numpy()).max()
        worst = max(worst, diff)
        assert diff < TOLERANCE, f"prompt {ids}: max |vLLM - transformers| = {diff:.2e}"
    print(f"worst prompt-logprob difference: {worst:.2e}")
