"""Benchmark: speculative decoding with n-gram drafts or a draft model, one client, through
the real server. Not a test.

Two `gateway serve` of the same model (the embedded default unless --model), one without
and one with `--speculative-config '{"method": "ngram", ...}'` (with --draft-model or
--draft-layers: `'{"model": DRAFT, ...}'`), both up, answer the same
input-grounded prompt set (PROMPTS: asking to repeat, quote or lightly edit a passage given
in the prompt, so the answers copy their prompts, the work n-gram lookup speeds up): one
client sends each chat request (greedy, up to --max-tokens) to one server then the other,
one request at a time, so a shared machine's load falls on both alike. Printed:
the CPU's flags, the dtype, output tokens/s of each server and their ratio, the acceptance
rate and the mean acceptance length (from the server's vllm:spec_decode_* counters), and
how many answers are identical (greedy: all of them, unless the two step shapes round a
near-tie differently).

    .venv/bin/python bench/bench_spec.py [--model PATH] [--k 5] [--lookup-min 2]
        [--lookup-max 5] [--max-tokens 192] [--dtype auto]
    .venv/bin/python bench/bench_spec.py --draft-model PATH [--k 4]
    .venv/bin/python bench/bench_spec.py --draft-layers 4    # a draft cut from the model
    .venv/bin/python bench/bench_spec.py --tiny    # a tiny random model: a quick run-through

No smaller model of the default model's tokenizer is at hand offline, so --draft-layers N
makes a draft from the served model itself: an HF folder of its first N layers (with its
embeddings, final norm and head; a GGUF is dequantized to float32 first).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_decode import cpu_flags  # noqa: E402
from bench.gguf_to_hf import convert  # noqa: E402
from tests.server import ServerProcess  # noqa: E402

SERVED = "bench"
PASSAGES = [
    "The old lighthouse stood at the edge of the harbor for more than a hundred years. "
    "Every night its keeper climbed the narrow stairs, wound the clockwork, and lit the "
    "lamp, so that the fishing boats could find their way home through the fog.",
    "def moving_average(values, window):\n    result = []\n    for i in range(len(values) "
    "- window + 1):\n        chunk = values[i:i + window]\n        result.append(sum(chunk) "
    "/ window)\n    return result\n",
    "Our return policy is simple: items may be returned within thirty days of delivery, in "
    "their original packaging, with the receipt. Refunds are issued to the original payment "
    "method within five business days after the item arrives at our warehouse.",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air "
    "pressure is lower, so water boils at a lower temperature, and food takes longer to "
    "cook. This is why pasta instructions sometimes differ in the mountains.",
]
TASKS = [
    "Repeat the following text exactly, word for word:\n\n{passage}",
    "Quote the following passage in full, then stop:\n\n{passage}",
    "Rewrite the following text without changing anything except that every sentence "
    "starts on a new line:\n\n{passage}",
]
PROMPTS = [task.format(passage=passage) for task in TASKS for passage in PASSAGES]


@dataclass
class Run:
    label: str
    seconds: float = 0.0
    output_tokens: int = 0
    answers: list[list[int]] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    worker_line: str = "?"

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def spec_counters(http: httpx.Client) -> dict[str, float]:
    """The server's vllm:spec_decode_* counters, summed over their labels."""
    values: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("vllm:spec_decode_"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            values[key] = values.get(key, 0.0) + float(value)
    return values


def measure(runs: list[Run], servers: list[ServerProcess], args: argparse.Namespace) -> None:
    """Each prompt to both servers in turn (the order alternating), so a shared machine's
    changing load falls on both alike; each server's time is its own requests'."""
    clients = [httpx.Client(base_url=server.url(), timeout=600) for server in servers]
    try:
        for run, server, http in zip(runs, servers, clients):
            match = re.search(r"Worker 0: .*", server.log_text())
            run.worker_line = match.group(0) if match else "?"
            _chat(http, PROMPTS[0], 8)  # warm-up: first-step costs are not the subject
        for _ in range(args.rounds):
            for index, prompt in enumerate(PROMPTS[:args.num_prompts]):
                order = [0, 1] if index % 2 == 0 else [1, 0]
                for which in order:
                    before = time.perf_counter()
                    answer = _chat(clients[which], prompt, args.max_tokens)
                    runs[which].seconds += time.perf_counter() - before
                    runs[which].answers.append(answer)
                    runs[which].output_tokens += len(answer)
        for run, http in zip(runs, clients):
            run.counters = spec_counters(http)
    finally:
        for http in clients:
            http.close()


def _chat(http: httpx.Client, prompt: str, max_tokens: int) -> list[int]:
    response = http.post("/v1/chat/completions", json={
        "model": SERVED, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True})
    response.raise_for_status()
    return list(response.json()["choices"][0]["token_ids"])


def report(plain: Run, spec: Run, args: argparse.Namespace,
           spec_config: dict[str, object]) -> None:
    print(f"\nCPU: {cpu_flags()}")
    print(f"dtype asked: {args.dtype}; load average now: {os.getloadavg()[0]:.1f}")
    for run in (plain, spec):
        print(f"  {run.label}: {run.worker_line}")
    print(f"prompt set: {min(args.num_prompts, len(PROMPTS))} input-grounded chat prompts "
          f"(repeat / quote / re-line a given passage), greedy, max_tokens {args.max_tokens}")
    print(f"speculative config: {json.dumps(spec_config)}")
    print(f"\n{'server':<14}{'tokens':>8}{'seconds':>9}{'tok/s':>9}")
    for run in (plain, spec):
        print(f"{run.label:<14}{run.output_tokens:>8}{run.seconds:>9.2f}{run.tokens_per_s:>9.1f}")
    counters = spec.counters
    drafts = counters.get("vllm:spec_decode_num_drafts_total", 0.0)
    drafted = counters.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    ratio = spec.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else float("nan")
    print(f"\nratio (with / without speculation): {ratio:.2f}x")
    print(f"acceptance rate: {accepted / drafted if drafted else 0.0:.1%} "
          f"({accepted:.0f} of {drafted:.0f} draft tokens, {drafts:.0f} drafts)")
    print(f"mean acceptance length: {1 + accepted / drafts if drafts else 1.0:.2f} "
          "tokens per verifying step")
    same = sum(a == b for a, b in zip(plain.answers, spec.answers))
    print(f"identical answers: {same} of {len(plain.answers)}")


def first_layers_draft(model: str | None, num_layers: int, out: Path) -> Path:
    """An HF folder of `model`'s first `num_layers` decoder layers (the same embeddings,
    final norm, head and tokenizer): a draft that shares the model's vocabulary."""
    from safetensors.numpy import load_file, save_file

    from gateway.models.info.paths import resolve_model_path
    path = resolve_model_path(model)
    if path.is_dir():
        shutil.copytree(path, out)
    else:
        convert(path, out)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for weights in out.glob("*.safetensors"):
        tensors = load_file(str(weights))
        kept = {name: array for name, array in tensors.items()
                if not name.startswith("model.layers.")
                or int(name.split(".")[2]) < num_layers}
        save_file(kept, str(weights), metadata={"format": "pt"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--rounds", type=int, default=1, help="passes over the prompts")
    parser.add_argument("--draft-model", default=None,
                        help="a draft model (path or id) instead of n-gram lookup")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="a draft model made of the served model's first N layers")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny random model and two short prompts (a run-through)")
    args = parser.parse_args()
    if args.tiny:
        from tests.tiny_model import build_tiny_llama
        args.model = str(build_tiny_llama(Path(tempfile.mkdtemp()) / "tiny"))
        args.dtype, args.max_tokens, args.num_prompts = "float32", 24, 2
    if args.draft_layers is not None:
        args.draft_model = str(first_layers_draft(
            args.model, args.draft_layers, Path(tempfile.mkdtemp()) / "draft"))
    spec_config: dict[str, object] = (
        {"model": args.draft_model, "num_speculative_tokens": args.k}
        if args.draft_model is not None else
        {"method": "ngram", "num_speculative_tokens": args.k,
         "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max})
    serve_args = ([args.model] if args.model else []) + [
        "--kv-cache-memory", "256MiB" if args.tiny else "1GiB", "--served-model-name", SERVED,
        "--dtype", args.dtype, "--disable-uvicorn-access-log", "--uvicorn-log-level",
        "warning"]
    runs = [Run("without"), Run("ngram" if args.draft_model is None else "draft model")]
    servers: list[ServerProcess] = []
    try:
        for flags in ([], ["--speculative-config", json.dumps(spec_config)]):
            servers.append(ServerProcess([*serve_args, *flags], env=dict(os.environ)).start())
        measure(runs, servers, args)
    finally:
        for server in servers:
            server.stop()
    report(*runs, args, spec_config)


if __name__ == "__main__":
    main()
