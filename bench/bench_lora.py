"""LoRA adapters under load, against the base model alone, through the real server. Not a
test.

One `gateway serve --enable-lora --max-loras A` with A random adapters of rank R on every
projection (written here in PEFT's layout for the served model's shapes), then the same load
twice: C clients each sending N completions (max_tokens T, ignore_eos) to the base model,
then the same C clients spread over the A adapters (client i on adapter i mod A), so every
step mixes all the adapters. Prints output tokens/s of both phases, their ratio, the CPU
flags and the worker's dtype line. The base phase runs on the same server (steps with no
adapter skip the LoRA products); `--also-plain` measures a server without --enable-lora too.

    .venv/bin/python bench/bench_lora.py [--model PATH | --default-model] [--clients 32]
        [--adapters 8] [--rank 16] [--requests 4] [--max-tokens 32] [--also-plain]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_decode import cpu_flags
from gateway.frontend.openai.lora import model_dims
from gateway.models.info.lora_adapter import PROJECTIONS, ModelDims
from gateway.models.info.paths import read_model_info
from tests.plugin_dists import subprocess_env
from tests.server import ServerProcess

SERVED = "base"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", help="an HF folder or .gguf file (default: a tiny Llama)")
    which.add_argument("--default-model", action="store_true",
                       help="the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4, help="per client, per phase")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--also-plain", action="store_true",
                        help="also measure the base model on a server without --enable-lora")
    return parser.parse_args()


def write_adapter(folder: Path, dims: ModelDims, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of every projection of every layer."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(dims.num_layers):
        for projection in PROJECTIONS:
            parent = "self_attn" if projection[0] in "qkvo" else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{projection}"
            for part in "AB":
                shape = dims.shape_of(projection, rank, part)
                tensors[f"{prefix}.lora_{part}.weight"] = torch.randn(
                    shape, generator=generator) * 0.01
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(PROJECTIONS), "base_model_name_or_path": SERVED}))
    return folder


async def run_phase(url: str, models: list[str], requests: int,
                    max_tokens: int) -> tuple[float, int]:
    """Seconds and output tokens of every client's requests, clients in parallel."""
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=len(models))) as client:
        async def one_client(model: str) -> int:
            tokens = 0
            for _ in range(requests):
                answer = await client.post("/v1/completions", json={
                    "model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True})
                answer.raise_for_status()
                tokens += answer.json()["usage"]["completion_tokens"]
            return tokens

        await asyncio.gather(*(one_client(model) for model in models[:4]))  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(one_client(model) for model in models))
        return time.perf_counter() - start, sum(counts)


def serve(model_args: list[str], extra: list[str], work: Path, label: str) -> ServerProcess:
    env = subprocess_env()
    env.pop("VLLM_API_KEY", None)
    return ServerProcess([*model_args, "--served-model-name", SERVED, "--max-model-len", "1024",
                          "--max-num-seqs", "64", "--disable-uvicorn-access-log", *extra],
                         env=env, log_path=work / f"{label}.log")


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        work = Path(tmp)
        if args.default_model:
            model_args = []
        elif args.model:
            model_args = [args.model]
        else:
            from tests.tiny_model import build_tiny_llama
            model_args = [str(build_tiny_llama(work / "tiny-llama", hidden_size=256,
                                               intermediate_size=768))]
        dims = model_dims(read_model_info(model_args[0] if model_args else None))
        modules = [f"lora{i}={write_adapter(work / f'lora{i}', dims, args.rank, i)}"
                   for i in range(args.adapters)]
        lora_flags = ["--enable-lora", "--max-loras", str(args.adapters), "--max-lora-rank",
                      str(args.rank), "--lora-modules", *modules]
        results: dict[str, tuple[float, int]] = {}
        with serve(model_args, lora_flags, work, "lora") as server:
            results["base model, --enable-lora server"] = asyncio.run(run_phase(
                server.url(), [SERVED] * args.clients, args.requests, args.max_tokens))
            models = [f"lora{i % args.adapters}" for i in range(args.clients)]
            results[f"{args.adapters} adapters"] = asyncio.run(run_phase(
                server.url(), models, args.requests, args.max_tokens))
            worker = re.search(r"Worker 0: .*", server.log_text())
        if args.also_plain:
            with serve(model_args, [], work, "plain") as server:
                results["base model, plain server"] = asyncio.run(run_phase(
                    server.url(), [SERVED] * args.clients, args.requests, args.max_tokens))
    model = model_args[0] if model_args else "default (SmolLM2-135M-Instruct)"
    print(f"\nmodel: {model}; {args.clients} clients x {args.requests} requests x "
          f"{args.max_tokens} tokens; adapters: {args.adapters} of rank {args.rank} on "
          f"every projection")
    rates = {label: tokens / seconds for label, (seconds, tokens) in results.items()}
    for label, rate in rates.items():
        seconds, tokens = results[label]
        print(f"  {label:<36}{rate:8.1f} output tokens/s ({tokens} tokens in {seconds:.1f} s)")
    base = rates["base model, --enable-lora server"]
    print(f"ratio {args.adapters} adapters / base model: "
          f"{rates[f'{args.adapters} adapters'] / base:.2f}")
    print(f"\nCPU: {cpu_flags()}")
    print(f"dtype: {worker.group(0) if worker else '?'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
