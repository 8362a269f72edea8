"""bench_gpu.py's phases that run torch in their own process (one child process a phase, so
a hang or a broken CUDA context ends that phase alone):

- models: the device's description, the random-weight models (transformers, bf16, saved as
  HF folders with the default model's tokenizer files), and the device-to-device copy
  bandwidth with each model's bandwidth floor (its weight bytes / that bandwidth);
- transformers: `generate` at batch 1 and one static batch (greedy, EOS ignored): tok/s and
  ms per step; and transformers' greedy tokens for the equality prompts;
- profile: one decode step of the gateway's own worker (its loader, model runner and
  sampler, in this process), wall time against the device's kernel time (torch.profiler).

    python -m bench.gpu_torch_phases ARGS.json     (written by bench_gpu.py)
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.gpu_common import (
    GREEDY_SEED,
    PhaseArgs,
    Plan,
    Record,
    child_main,
    measured,
    model_folder,
    random_prompts,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def device_of(plan: Plan) -> torch.device:
    if plan.dry_run:
        # one thread: the tiny models gain nothing from more, and a second thread's spinning
        # against the child started ahead of the next phase would only slow both
        torch.set_num_threads(1)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device (torch.cuda.is_available() is False)")
    return torch.device("cuda")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe_device(device: torch.device) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "python": platform.python_version(), "cpu_cores": os.cpu_count()}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(name=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    memory_gib=round(properties.total_memory / 2**30, 1),
                    capability=".".join(map(str, torch.cuda.get_device_capability(device))))
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    else:
        info["name"] = f"CPU: {platform.processor() or platform.machine()} (dry run)"
    return info


# ------------------------------------------------------------------ models + bandwidth
def models_phase(args: PhaseArgs, record: Record) -> None:
    device = device_of(args.plan)
    record.set("device", describe_device(device))
    print(f"[models] device: {record.data['device'].get('name')}", flush=True)
    tokenizer = Path(args.extra["tokenizer"])
    for index, (name, shape) in enumerate(args.plan.shapes.items()):
        measured(record, ("models", name), make_model, shape, model_folder(args.work, name),
                 tokenizer, device, index)
    measured(record, ("bandwidth",), measure_bandwidth, args.plan, device, record)


def make_model(shape: dict[str, Any], folder: Path, tokenizer: Path, device: torch.device,
               seed: int) -> dict[str, Any]:
    """A random-weight LlamaForCausalLM of `shape`, made on `device`, saved in bf16 as an HF
    folder with the tokenizer files beside it."""
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    started = time.perf_counter()
    special = read_special_tokens(tokenizer)
    vocabulary = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    config = LlamaConfig(**shape, bos_token_id=vocabulary.token_to_id(special["bos"]),
                         eos_token_id=vocabulary.token_to_id(special["eos"]))
    torch.manual_seed(seed)
    with torch.device(device):
        model: Any = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    made_s = time.perf_counter() - started
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for file in TOKENIZER_FILES:
        shutil.copy(tokenizer / file, folder / file)
    parameters = list(model.parameters())  # a tied embedding counted once
    weight_bytes = sum(p.numel() * p.element_size() for p in parameters)
    embedding = model.get_input_embeddings().weight
    # an untied input embedding is gathered row by row, never streamed whole in a step
    untied_embedding_bytes = (0 if config.tie_word_embeddings
                              else embedding.numel() * embedding.element_size())
    print(f"[models] {folder.name}: {sum(p.numel() for p in parameters) / 1e9:.3f} B "
          f"parameters, made in {made_s:.1f} s, saved in "
          f"{time.perf_counter() - started - made_s:.1f} s", flush=True)
    del model
    return {"folder": str(folder), "shape": shape,
            "parameters": sum(p.numel() for p in parameters), "weight_bytes": weight_bytes,
            "streamed_bytes_per_step": weight_bytes - untied_embedding_bytes,
            "seconds": round(time.perf_counter() - started, 2)}


def read_special_tokens(tokenizer: Path) -> dict[str, str]:
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    return {"bos": config["bos_token"], "eos": config["eos_token"]}


def measure_bandwidth(plan: Plan, device: torch.device, record: Record) -> dict[str, Any]:
    """Device-to-device copy bandwidth (bytes read + bytes written per second, as CUDA's
    bandwidthTest counts a copy), then each model's floor: its weight bytes / that."""
    source = torch.ones(plan.copy_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    repeats = 20
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            target.copy_(source)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000 / repeats
        timer = "CUDA events"
    else:
        times = []
        for _ in range(repeats):
            begun = time.perf_counter()
            target.copy_(source)
            times.append(time.perf_counter() - begun)
        seconds, timer = statistics.median(times), "perf_counter (CPU)"
    bandwidth = 2 * plan.copy_bytes / seconds
    floors = {}
    for name, model in record.data.get("models", {}).items():
        if "weight_bytes" in model:
            floors[name] = {"floor_ms_per_step": 1000 * model["weight_bytes"] / bandwidth,
                            "streamed_floor_ms_per_step":
                                1000 * model["streamed_bytes_per_step"] / bandwidth}
    print(f"[models] copy bandwidth {bandwidth / 1e9:.0f} GB/s ({timer}); floors: "
          + ", ".join(f"{n} {f['floor_ms_per_step']:.3f} ms" for n, f in floors.items()),
          flush=True)
    return {"copy_bytes": plan.copy_bytes, "timer": timer, "seconds_per_copy": seconds,
            "gb_per_s": bandwidth / 1e9, "floors": floors}


# ------------------------------------------------------------------ transformers
def load_hf_model(folder: Path, dtype: str, device: torch.device) -> Any:
    import transformers
    from transformers import LlamaForCausalLM

    # transformers 5 names the argument `dtype`; older releases `torch_dtype`
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    options: dict[str, Any] = {key: _DTYPES[dtype]}
    model: Any = LlamaForCausalLM.from_pretrained(str(folder), **options)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: always the full length
    return model


def hf_generate(model: Any, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    generated = out[:, input_ids.shape[1]:]
    if generated.shape[1] != new_tokens:
        raise RuntimeError(f"generate made {generated.shape[1]} tokens, not {new_tokens}")
    return generated


def transformers_phase(args: PhaseArgs, record: Record) -> None:
    """extra: `dtype` (the throughput runs'), `reference_dtypes` {model: [dtype, ...]}."""
    plan, device = args.plan, device_of(args.plan)
    record.set("device", describe_device(device))
    for name, shape in plan.shapes.items():
        folder = model_folder(args.work, name)
        dtypes = [args.extra["dtype"], *[d for d in args.extra["reference_dtypes"].get(name, [])
                                         if d != args.extra["dtype"]]]
        for dtype in dtypes:
            model = measured(record, ("models", name, dtype), load_hf_model, folder, dtype,
                             device)
            if model is None:
                continue
            if dtype == args.extra["dtype"]:
                for batch in plan.hf_batches:
                    measured(record, ("generate", name, f"batch_{batch}"), measure_generate,
                             model, plan, shape, batch, device)
            if dtype in args.extra["reference_dtypes"].get(name, []):
                measured(record, ("greedy", name, dtype), greedy_tokens, model, plan, shape,
                         device)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()


def measure_generate(model: Any, plan: Plan, shape: dict[str, Any], batch: int,
                     device: torch.device) -> dict[str, Any]:
    prompts = torch.tensor(random_prompts(batch, plan.prompt_len, shape["vocab_size"],
                                          seed=batch), device=device)
    hf_generate(model, prompts, 4)  # warm-up
    synchronize(device)
    started = time.perf_counter()
    hf_generate(model, prompts, plan.output_len)
    synchronize(device)
    seconds = time.perf_counter() - started
    result = {"batch": batch, "new_tokens": plan.output_len, "seconds": seconds,
              "tok_s": batch * plan.output_len / seconds,
              "ms_per_step": 1000 * seconds / plan.output_len}
    print(f"[transformers] {batch:>4} x {plan.output_len} tokens: {result['tok_s']:.0f} tok/s, "
          f"{result['ms_per_step']:.2f} ms/step", flush=True)
    return result


def greedy_tokens(model: Any, plan: Plan, shape: dict[str, Any],
                  device: torch.device) -> dict[str, Any]:
    """transformers' greedy tokens for the equality prompts, one prompt at a time (batch 1,
    as the server runs them)."""
    prompts = random_prompts(plan.greedy_prompts, plan.greedy_prompt_len, shape["vocab_size"],
                             GREEDY_SEED)
    return {"tokens": [hf_generate(model, torch.tensor([p], device=device),
                                   plan.greedy_tokens)[0].tolist() for p in prompts]}


# ------------------------------------------------------------------ profile
def profile_phase(args: PhaseArgs, record: Record) -> None:
    """extra: `model` (a name of plan.shapes), `dtype`."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (the step driver)
    from gateway.config import CacheConfig, EngineConfig, ModelConfig
    from gateway.worker.worker import Worker

    plan, name = args.plan, args.extra["model"]
    record.set("source", "the gateway's worker in process (its loader, model runner and "
                         "sampler), driven by tests/step_driver.py")
    record.set("model", name)
    worker = Worker(EngineConfig(
        model=ModelConfig(model=str(model_folder(args.work, name)), dtype=args.extra["dtype"]),
        cache=CacheConfig(kv_cache_memory_gib=0.05 if plan.dry_run else 1.0)))
    worker.init_device()
    worker.load_model()
    num_blocks = worker.initialize_kv_cache()
    device = worker.device
    assert device is not None
    record.set("device", {"torch_device": str(device), "dtype": str(worker.dtype)})
    for batch in plan.profile_batches:
        measured(record, ("batches", str(batch)), profile_decode, worker, num_blocks, plan,
                 batch, device)


def profile_decode(worker: Any, num_blocks: int, plan: Plan, batch: int,
                   device: torch.device) -> dict[str, Any]:
    from gateway.sampling_params import SamplingParams
    from tests.step_driver import StepDriver

    driver = StepDriver(worker, num_blocks)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1_000_000)
    vocab_size = worker.vocab_size
    requests = [driver.add(f"b{batch}-{i}", prompt, params) for i, prompt in
                enumerate(random_prompts(batch, plan.prompt_len, vocab_size, seed=batch))]
    while any(r.num_computed < len(r.prompt) for r in requests):  # the prefill
        driver.step()
    for _ in range(3):  # warm-up decode steps
        driver.step()

    def step() -> None:
        driver.step()
        synchronize(device)

    wall_ms = 1000 * statistics.median(_timed(step) for _ in range(plan.timed_steps))
    result = {"batch": batch, "wall_ms_per_step": wall_ms,
              **profiled(step, plan.profile_steps, device)}
    # the device's (or ops') time against the step's wall time outside the profiler
    result["busy_fraction"] = result["kernel_ms_per_step"] / wall_ms
    for request in requests:
        driver.finish(request.req_id)
    driver.step()  # hands the finished ids to the runner
    print(f"[profile] batch {batch}: {result['wall_ms_per_step']:.2f} ms wall/step, "
          f"{result['kernel_ms_per_step']:.2f} ms {result['timer']}, "
          f"{result['kernels_per_step']:.0f} {result['unit']}/step", flush=True)
    return result


def _timed(step: Callable[[], None]) -> float:
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def profiled(step: Callable[[], None], num_steps: int, device: torch.device
             ) -> dict[str, Any]:
    """torch.profiler over `num_steps` steps: on CUDA the device's kernels (and copies) per
    step, their summed duration and the busiest; on the CPU, the ops' self CPU time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(num_steps):
            step()
    profiled_wall = (time.perf_counter() - started) / num_steps
    # name -> (count, microseconds) over the profiled steps
    by_name: dict[str, tuple[int, float]] = {}
    if on_cuda:
        for event in prof.events():
            if event.device_type == DeviceType.CUDA:
                count, total = by_name.get(event.name, (0, 0.0))
                by_name[event.name] = (count + 1, total + event.time_range.elapsed_us())
        timer, unit = "GPU kernel time", "kernels"
    else:  # the ops' self times add up to the time spent in ops
        by_name = {a.key: (a.count, a.self_cpu_time_total) for a in prof.key_averages()}
        timer, unit = "op self CPU time", "ops"
    total_us = sum(total for _, total in by_name.values())
    busiest = sorted(by_name.items(), key=lambda item: -item[1][1])[:8]
    return {"timer": timer, "unit": unit, "kernel_ms_per_step": total_us / 1000 / num_steps,
            "kernels_per_step": sum(count for count, _ in by_name.values()) / num_steps,
            "profiled_wall_ms_per_step": 1000 * profiled_wall,
            "busiest": [{"name": name[:80], "per_step": count / num_steps,
                         "ms_per_step": total / 1000 / num_steps}
                        for name, (count, total) in busiest]}


def preload(kind: str) -> None:
    """The imports a phase of `kind` needs (done while the phase before it runs)."""
    if kind in ("models", "transformers"):
        from transformers import LlamaForCausalLM  # noqa: F401
    elif kind == "profile":
        import gateway.worker.worker  # noqa: F401


if __name__ == "__main__":
    child_main({"models": models_phase, "transformers": transformers_phase,
                "profile": profile_phase}, preload)
