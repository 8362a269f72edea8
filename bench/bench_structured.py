"""Structured outputs: what the grammar masks cost, in one run.

Not a test. One engine core (in-process, the default model unless --model) runs rounds of
--requests concurrent greedy requests, alternating (free, half, half, free, ...): "free"
has no constraint; "half" holds every second request to a JSON schema of its own (a long
string field, minLength past max_tokens, so constrained requests run as long as free
ones). It prints tokens/s of each kind of round and their ratio; the mask's time per step
(the engine core filling the bitmask rows and advancing the matchers, the worker applying
them to the logits) against the whole step; and the first-token latency of a request with
a schema never seen (compilation) against one whose grammar is cached.

    .venv/bin/python bench/bench_structured.py                 # default model, a few minutes
    .venv/bin/python bench/bench_structured.py --quick         # a short smoke run

Target: the mask under 10% of the step at batch 32.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gateway.worker.model_runner as model_runner  # noqa: E402
from gateway.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from gateway.engine.core import EngineCore  # noqa: E402
from gateway.messages import EngineCoreRequest  # noqa: E402
from gateway.sampling_params import SamplingParams  # noqa: E402
from gateway.structured_outputs_params import StructuredOutputsParams  # noqa: E402
from gateway.tokenizer import load_tokenizer  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."


class Timer:
    """Adds up the seconds spent in a wrapped callable."""

    def __init__(self, func):  # type: ignore[no-untyped-def]
        self.func, self.seconds = func, 0.0

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        try:
            return self.func(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


def schema(tag: str, max_tokens: int) -> str:
    return json.dumps({"type": "object", "properties": {f"story_{tag}": {
        "type": "string", "minLength": 8 * max_tokens}}, "required": [f"story_{tag}"]})


def params(max_tokens: int, constraint: str | None) -> SamplingParams:
    structured = None if constraint is None else StructuredOutputsParams(json=constraint)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          structured_outputs=structured)


def run_round(core: EngineCore, prompt: list[int], all_params: list[SamplingParams],
              tag: str) -> tuple[int, float, int]:
    """Run the requests together to their ends: (tokens, seconds, steps)."""
    for i, request_params in enumerate(all_params):
        core.add_request(EngineCoreRequest(f"{tag}-{i}", prompt, request_params, time.time()))
    tokens, steps, started = 0, 0, time.perf_counter()
    while core.has_work():
        tokens += sum(len(o.new_token_ids) for o in core.step().outputs)
        steps += 1
    return tokens, time.perf_counter() - started, steps


def first_token_seconds(core: EngineCore, prompt: list[int], request_params: SamplingParams,
                        request_id: str) -> float:
    started = time.perf_counter()
    core.add_request(EngineCoreRequest(request_id, prompt, request_params, time.time()))
    first = None
    while core.has_work():
        outputs = core.step().outputs
        if first is None and any(o.new_token_ids for o in outputs):
            first = time.perf_counter() - started
    assert first is not None
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.rounds = 8, 8, 2
    config = EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype),
                          cache=CacheConfig(kv_cache_memory_gib=0.5),
                          scheduler=SchedulerConfig(max_num_seqs=max(32, args.requests),
                                                    max_num_batched_tokens=2048))
    core = EngineCore(config)
    prompt = load_tokenizer(args.model).encode(PROMPT)
    fill = core.structured.attach_bitmask = Timer(core.structured.attach_bitmask)
    advance = core.structured.advance = Timer(core.structured.advance)
    apply = model_runner.apply_grammar_bitmask = Timer(model_runner.apply_grammar_bitmask)

    # Warm-up: the grammar backend (tokenizer vocabulary) and one compile.
    first_token_seconds(core, prompt, params(2, schema("warm", 2)), "warm")
    new = first_token_seconds(core, prompt, params(2, schema("new", 2)), "new")
    cached = first_token_seconds(core, prompt, params(2, schema("new", 2)), "cached")

    rates: dict[str, list[float]] = {"free": [], "half": []}
    step_seconds, mask_seconds = 0.0, 0.0
    order = ["free", "half", "half", "free"] * ((args.rounds + 3) // 4)
    for number, kind in enumerate(order[:max(2, args.rounds)]):
        all_params = [params(args.max_tokens, schema(f"{number}-{i}", args.max_tokens)
                             if kind == "half" and i % 2 else None)
                      for i in range(args.requests)]
        before = fill.seconds + advance.seconds + apply.seconds
        tokens, seconds, steps = run_round(core, prompt, all_params, f"round{number}")
        rates[kind].append(tokens / seconds)
        if kind == "half":
            step_seconds += seconds
            mask_seconds += fill.seconds + advance.seconds + apply.seconds - before
    core.shutdown()

    free, half = statistics.median(rates["free"]), statistics.median(rates["half"])
    print(f"CPU: {platform.processor() or platform.machine()}, flags: {_cpu_flags()}; "
          f"dtype {args.dtype}; {args.requests} concurrent, {args.max_tokens} tokens each "
          "(shared machine: compare the ratios, not the figures)")
    print(f"throughput  free: {free:8.1f} tok/s   half constrained: {half:8.1f} tok/s   "
          f"ratio half/free: {half / free:.3f}")
    print(f"mask cost   {100 * mask_seconds / step_seconds:.1f}% of the constrained rounds' "
          f"step time (fill {fill.seconds * 1e3:.0f} ms, advance {advance.seconds * 1e3:.0f}"
          f" ms, apply {apply.seconds * 1e3:.0f} ms in all)")
    print(f"first token new schema: {new * 1e3:.0f} ms   cached schema: {cached * 1e3:.0f} ms"
          f"   ratio new/cached: {new / cached:.2f}")


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
    return ",".join(f for f in wanted if f in flags) or "none of avx2/fma/avx512"


if __name__ == "__main__":
    main()
