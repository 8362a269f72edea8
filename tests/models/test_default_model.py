"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in float32: greedy continuations
equal transformers' token for token, with transformers dequantising the same GGUF itself.

(transformers' `from_pretrained(gguf_file=...)` needs `accelerate`, which the project does
not depend on, so the reference is built from transformers' own GGUF loader.)"""

from __future__ import annotations

import pytest
import torch

from gateway.config import CacheConfig, EngineConfig, ModelConfig
from gateway.models.info.paths import default_model_path
from gateway.sampling_params import SamplingParams
from gateway.tokenizer import load_tokenizer
from gateway.worker.worker import Worker
from tests.step_driver import StepDriver

pytestmark = pytest.mark.e2e

NUM_TOKENS = 20
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "What colour is the sky on a clear day?"}],
]


@pytest.fixture(scope="module")
def reference():  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = str(default_model_path())
    model = LlamaForCausalLM(LlamaConfig(**load_gguf_checkpoint(path)["config"]))
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.float().eval()


@pytest.fixture(scope="module")
def worker() -> Worker:
    # dequantized, as transformers runs it (kept quantized: tests/models/test_quantized.py)
    worker = Worker(EngineConfig(model=ModelConfig(dtype="float32", quantization="none"),
                                 cache=CacheConfig(kv_cache_memory_gib=0.1)))
    worker.init_device()
    worker.load_model()
    worker.initialize_kv_cache()
    return worker


def test_greedy_continuations_equal_transformers(worker: Worker, reference) -> None:  # type: ignore[no-untyped-def]
    tokenizer = load_tokenizer(None)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(chat)) for chat in CHATS]
    runner = worker.model_runner
    assert runner is not None
    driver = StepDriver(worker, runner.num_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    requests = [driver.add(f"chat{i}", prompt, params) for i, prompt in enumerate(prompts)]
    for _ in range(NUM_TOKENS):
        driver.step()  # the three run as one batch
    for request in requests:
        assert request.output == _greedy(reference, request.prompt, NUM_TOKENS), \
            tokenizer.decode(request.output)
    assert "Paris" in tokenizer.decode(requests[0].output)


@torch.inference_mode()
def _greedy(model, prompt: list[int], num_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Plain greedy decoding with transformers' KV cache; no stop on EOS (like ignore_eos)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    for _ in range(num_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([tokens[-1:]]), cache=out.cache,
                    use_cache=True)
    return tokens
