"""The engine client and the engine-core process, end to end on a tiny random model."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from gateway.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from gateway.frontend.engine_client.client import AsyncEngineClient
from gateway.frontend.engine_client.errors import EngineDeadError
from gateway.sampling_params import SamplingParams
from tests.conftest import run_gateway, run_python
from tests.plugin_dists import write_dist

GREEDY = dict(temperature=0.0, ignore_eos=True)


class LoopThread:
    """An event loop in a thread, so sync tests can share one engine client."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def config(model, max_model_len=None, **cache):
    return EngineConfig(model=ModelConfig(model=str(model), dtype="float32",
                                          max_model_len=max_model_len),
                        cache=CacheConfig(**{"kv_cache_memory_gib": 0.01, **cache}),
                        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64))


@pytest.fixture(scope="module")
def engine(tiny_llama):
    loop = LoopThread()
    client = loop.run(AsyncEngineClient.start(config(tiny_llama)))
    yield loop, client
    loop.run(client.shutdown())
    loop.close()


async def collect(client, ids, params, request_id):
    outputs = [o async for o in client.generate(ids, params, request_id)]
    return outputs[-1]


def test_handshake_reports_tasks_capacity_and_the_core_plugin_report(engine):
    _, client = engine
    assert client.supported_tasks == ("generate",)
    assert client.num_kv_blocks > 0 and client.block_size == 16
    assert client.engine_pid != os.getpid()
    assert client.latest_stats is None or client.latest_stats.num_running_reqs == 0


def test_concurrent_requests_of_different_lengths_match_running_alone(engine):
    loop, client = engine
    tok = client.tokenizer
    prompts = [tok.encode(t) for t in ["Hello", "The quick brown fox jumps over the lazy dog.",
                                       "Once upon a time there was", "0123456789",
                                       "Summarize the following text in one sentence. " * 3]]
    lengths = [5, 23, 11, 17, 8]
    alone = [loop.run(collect(client, p, SamplingParams(max_tokens=n, **GREEDY), f"alone{i}"))
             for i, (p, n) in enumerate(zip(prompts, lengths))]

    async def together():
        return await asyncio.gather(*(
            collect(client, p, SamplingParams(max_tokens=n, **GREEDY), f"together{i}")
            for i, (p, n) in enumerate(zip(prompts, lengths))))

    for a, b, n in zip(alone, loop.run(together()), lengths):
        assert len(b.token_ids) == n and b.finish_reason == "length"
        assert b.token_ids == a.token_ids and b.text == a.text


@pytest.mark.parametrize(("params", "field"), [
    (SamplingParams(max_tokens=2, stop=["ok", "\ud800"]), "stop"),
    (SamplingParams(max_tokens=2, extra_args={"k": "\udfff"}), "vllm_xargs"),
])
def test_a_request_that_cannot_be_sent_is_refused_and_leaves_nothing(engine, params, field):
    from gateway.sampling_params import InvalidParameterError

    loop, client = engine
    with pytest.raises(InvalidParameterError) as refused:
        loop.run(collect(client, [1, 2, 3], params, f"unsendable-{field}"))
    assert refused.value.param == field
    assert client.num_inflight_requests == 0
    assert loop.run(collect(client, [1, 2, 3], SamplingParams(max_tokens=2, **GREEDY),
                            f"after-{field}"))


def test_abort_mid_generation_frees_the_cache(engine):
    loop, client = engine
    ids = client.tokenizer.encode("Hello")

    async def start_then_drop():
        stream = client.generate(ids, SamplingParams(max_tokens=3000, **GREEDY), "to-abort")
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 5:
                break
        await stream.aclose()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            stats = client.latest_stats
            if stats.num_running_reqs == 0 and stats.num_free_blocks == stats.num_total_blocks:
                return stats
            await asyncio.sleep(0.01)
        return client.latest_stats

    stats = loop.run(start_then_drop())
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.num_free_blocks == stats.num_total_blocks == client.num_kv_blocks


def test_invalid_prompt_tokens_fail_the_request_with_a_parameter_error(engine):
    loop, client = engine
    out = loop.run(collect(client, [1, client.vocab_size + 5], SamplingParams(), "bad"))
    assert out.finished and out.finish_reason == "error"
    assert out.error_kind == "invalid_request" and out.error_param == "prompt"
    assert str(client.vocab_size + 5) in out.error


def test_small_cache_preempts_and_still_matches(tiny_llama):
    loop = LoopThread()
    # 2 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 bytes = 8 KiB a block: 12 blocks.
    client = loop.run(AsyncEngineClient.start(config(tiny_llama, max_model_len=192,
                                                kv_cache_memory_gib=12 * 8192 / 2**30)))
    try:
        assert client.num_kv_blocks == 12
        ids = client.tokenizer.encode("Once upon a time")
        params = SamplingParams(max_tokens=40, **GREEDY)
        alone = loop.run(collect(client, ids, params, "solo"))

        async def crowd():
            return await asyncio.gather(*(collect(client, ids, params, f"c{i}") for i in range(6)))

        outs = loop.run(crowd())
        assert all(o.token_ids == alone.token_ids for o in outs)
        assert client.latest_stats.num_free_blocks == 12
    finally:
        loop.run(client.shutdown())
        loop.close()


def test_engine_death_fails_pending_requests_and_is_reported(tiny_llama):
    loop = LoopThread()
    client = loop.run(AsyncEngineClient.start(config(tiny_llama)))
    ids = client.tokenizer.encode("Hello")

    async def generate_then_kill():
        stream = client.generate(ids, SamplingParams(max_tokens=5000, **GREEDY), "doomed")
        await stream.__anext__()
        os.kill(client.engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        return time.monotonic() - killed

    try:
        assert loop.run(generate_then_kill()) < 2.0
        assert client.is_dead and "exited" in client.dead_reason
        with pytest.raises(EngineDeadError):
            loop.run(collect(client, ids, SamplingParams(), "after"))
    finally:
        loop.run(client.shutdown())
        loop.close()


def test_general_plugins_run_once_in_the_front_end_and_once_in_the_engine_core(site, tiny_llama):
    write_dist(site, "role-recorder", {"vllm.general_plugins": {"recorder": "recorder_mod:record"}},
               {"recorder_mod": """
                    import os
                    def record():
                        from gateway.plugins.process import process_role
                        with open(os.environ["MARKER"], "a") as f:
                            f.write(f"{process_role()} {os.getpid()}\\n")
               """})
    marker = site / "calls.txt"
    script = f"""
import asyncio, os
from gateway.plugins import load_general_plugins, set_process_role
from gateway.config import EngineConfig, ModelConfig, CacheConfig
from gateway.frontend.engine_client.client import AsyncEngineClient
from gateway.sampling_params import SamplingParams

async def main():
    client = await AsyncEngineClient.start(EngineConfig(
        model=ModelConfig(model={str(tiny_llama)!r}, dtype="float32"),
        cache=CacheConfig(kv_cache_memory_gib=0.01)))
    ids = client.tokenizer.encode("Hi")
    async for out in client.generate(ids, SamplingParams(max_tokens=3), "one"):
        pass
    roles = sorted((r["process_role"], r["outcome"]) for r in client.plugin_reports()
                   if r["name"] == "recorder")
    print(roles, client.engine_pid)
    await client.shutdown()

if __name__ == "__main__":
    set_process_role("api-server")
    load_general_plugins()
    asyncio.run(main())
"""
    path = site / "front_end.py"
    path.write_text(script)
    proc = run_python(f"import runpy; runpy.run_path({str(path)!r}, run_name='__main__')",
                      site, MARKER=str(marker))
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = sorted(line.split() for line in marker.read_text().splitlines())
    assert [role for role, _ in calls] == ["api-server", "engine-core"]
    assert calls[0][1] != calls[1][1]
    assert "[('engine-core', 'called')]" in proc.stdout


def test_llm_class_and_generate_command_work_offline(site, tiny_llama):
    script = site / "offline.py"
    script.write_text(f"""
from gateway import LLM
from gateway.sampling_params import SamplingParams
if __name__ == "__main__":
    with LLM({str(tiny_llama)!r}, dtype="float32", kv_cache_memory_gib=0.01) as llm:
        outs = llm.generate(["Hello", "Once upon"], SamplingParams(max_tokens=4, temperature=0,
                                                                   ignore_eos=True))
        print([len(o.token_ids) for o in outs], [o.finish_reason for o in outs])
""")
    proc = run_python(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[4, 4] ['length', 'length']" in proc.stdout
    cli = run_gateway("generate", "--model", str(tiny_llama), "--dtype", "float32",
                      "--max-tokens", "6", "--kv-cache-memory", "0.01", "Hello")
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert cli.stdout.strip()


def test_the_llm_class_takes_vllm_s_kv_cache_keywords_and_refuses_bad_ones(tiny_llama):
    proc = run_python(f"""
from gateway import LLM
from gateway.sampling_params import SamplingParams
for kwargs in (dict(kv_cache_memory_bytes=2**20, kv_cache_memory_gib=1.0),
               dict(gpu_memory_utilization=1.5),
               dict(speculative_config={{"method": "ngram", "model": "draft",
                                         "num_speculative_tokens": 2}})):
    try:
        LLM({str(tiny_llama)!r}, **kwargs)
    except ValueError as exc:
        print("refused:", exc)
params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
with LLM({str(tiny_llama)!r}, dtype="float32", kv_cache_memory_bytes=2**20) as llm:
    print("blocks:", llm.engine.num_kv_blocks)
    plain = llm.generate(["Once upon"], params)[0].token_ids
draft = {{"model": {str(tiny_llama)!r}, "num_speculative_tokens": 2}}
with LLM({str(tiny_llama)!r}, dtype="float32", kv_cache_memory_bytes=2**20,
         speculative_config=draft) as llm:
    print("blocks with a draft:", llm.engine.num_kv_blocks)
    print("same tokens:", llm.generate(["Once upon"], params)[0].token_ids == plain)
""")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: give kv_cache_memory_bytes or kv_cache_memory_gib, not both" in proc.stdout
    assert "refused: gpu_memory_utilization must be in (0, 1], got 1.5" in proc.stdout
    assert ("refused: speculative_config: field 'model': method 'ngram' takes no draft "
            "model") in proc.stdout
    assert "blocks: 128" in proc.stdout  # 1 MiB in the tiny model's float32 blocks of 8 KiB
    assert "blocks with a draft: 64" in proc.stdout  # the draft's blocks are as large
    assert "same tokens: True" in proc.stdout
