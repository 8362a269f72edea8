"""`gateway generate "prompt"`: run the model offline and stream its text as it comes."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from typing import Any

from gateway.config import CacheConfig, EngineConfig, ModelConfig


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("generate", help="generate text offline (no server)",
                            description=__doc__)
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--model", default=None,
                        help="a .gguf file or HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--chat", action="store_true",
                        help="apply the model's chat template to the prompt as a user message")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", type=float, default=0.25,
                        help="KV-cache budget in GiB (default 0.25)")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_generate(args))


async def _generate(args: argparse.Namespace) -> int:
    from gateway.frontend.engine_client.client import AsyncEngineClient
    from gateway.frontend.engine_client.errors import EngineStartError
    from gateway.sampling_params import InvalidParameterError, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed)
    except InvalidParameterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype),
                          cache=CacheConfig(kv_cache_memory_gib=args.kv_cache_memory))
    try:
        client = await AsyncEngineClient.start(config)
    except (EngineStartError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        tokenizer = client.tokenizer
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                 add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(args.prompt)
        final = None
        async for output in client.generate(ids, params, uuid.uuid4().hex):
            sys.stdout.write(output.delta_text)
            sys.stdout.flush()
            final = output
        sys.stdout.write("\n")
        if final is not None and final.error:
            print(f"error: {final.error}", file=sys.stderr)
            return 1
        return 0
    finally:
        await client.shutdown()
