"""Offline use: `gateway.LLM(model).generate(prompts, sampling_params)`.

The engine core runs in its own process (spawn), so a script that uses LLM must guard its
entry point with `if __name__ == "__main__":`, as with any multiprocessing program.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Sequence
from typing import Any

from gateway.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from gateway.frontend.engine_client.client import AsyncEngineClient
from gateway.outputs import RequestOutput
from gateway.process_start import load_process_plugins
from gateway.sampling_params import SamplingParams


class LLM:
    """A model behind its own engine core, driven from ordinary (synchronous) code.

    `model`: a .gguf file, an HF folder or a Hugging Face repo id (`revision`,
    `download_dir` as in vLLM's LLM); None is the embedded default model. Other
    keywords: dtype, max_model_len, max_num_seqs, max_num_batched_tokens, seed, and the KV
    cache's size as vLLM's LLM takes it: gpu_memory_utilization (a CUDA device's share),
    or kv_cache_memory_bytes (or kv_cache_memory_gib) for a fixed budget; enforce_eager
    and max_cudagraph_capture_size for the CUDA graphs of decode steps;
    speculative_config (a dict of vLLM's fields, as --speculative-config takes in JSON).

    The general plugins are loaded in the calling process first (once per process); one
    that raises stops here with a PluginError naming it.
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, kv_cache_memory_gib: float | None = None,
                 kv_cache_memory_bytes: int | None = None,
                 gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                 seed: int = 0, logits_processors: Sequence[str] = (),
                 revision: str | None = None, download_dir: str | None = None,
                 enforce_eager: bool = False,
                 max_cudagraph_capture_size: int | None = None,
                 speculative_config: dict[str, Any] | None = None) -> None:
        # As vLLM's LLM does: this process's general plugins run before anything else, so
        # a plugin may register a model architecture or change settings for the engine.
        load_process_plugins()
        if kv_cache_memory_bytes is not None:
            if kv_cache_memory_gib is not None:
                raise ValueError("give kv_cache_memory_bytes or kv_cache_memory_gib, not both")
            kv_cache_memory_gib = kv_cache_memory_bytes / 1024**3
        try:
            speculative = None if speculative_config is None \
                else SpeculativeConfig.from_dict(speculative_config)
        except ValueError as exc:
            raise ValueError(f"speculative_config: {exc}") from None
        config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                              logits_processors=list(logits_processors), revision=revision,
                              download_dir=download_dir),
            cache=CacheConfig(kv_cache_memory_gib=kv_cache_memory_gib,
                              gpu_memory_utilization=gpu_memory_utilization),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens),
            compilation=CompilationConfig(enforce_eager=enforce_eager,
                                          max_cudagraph_capture_size=max_cudagraph_capture_size),
            speculative=speculative)
        config.cache.validate()
        config.compilation.validate()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gateway-llm",
                                        daemon=True)
        self._thread.start()
        self.engine: AsyncEngineClient = self._run(AsyncEngineClient.start(config))
        self.tokenizer = self.engine.tokenizer

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) concurrently; outputs in order."""
        items: list[str | list[int]] = (
            [prompts] if isinstance(prompts, str) else list(prompts))  # type: ignore[arg-type]
        params = sampling_params or SamplingParams()
        token_lists: list[list[int]] = [
            self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            for p in items]
        return list(self._run(self._generate_all(token_lists, params)))

    def chat(self, messages: list[dict[str, Any]],
             sampling_params: SamplingParams | None = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.generate([ids], sampling_params)[0]

    async def _generate_all(self, token_lists: list[list[int]],
                            params: SamplingParams) -> list[RequestOutput]:
        return await asyncio.gather(*(self._generate_one(ids, params) for ids in token_lists))

    async def _generate_one(self, ids: list[int], params: SamplingParams) -> RequestOutput:
        final = None
        async for output in self.engine.generate(ids, params, uuid.uuid4().hex):
            final = output
        assert final is not None
        if final.error is not None:
            raise RuntimeError(final.error)
        return final

    def shutdown(self) -> None:
        if self._loop.is_running():
            self._run(self.engine.shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()  # its self-pipe sockets too

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
