"""Benchmark: a mixture-of-experts decode step costs its active parameters' bytes, not its
total's. Not a test.

A Qwen3-30B-A3B-shaped layer stack (hidden 2048, 128 experts of 768, 8 active, 32 query
and 4 KV heads of 128; random weights, --layers of them, a 512-token vocabulary so the
layers dominate) is served by the gateway's worker, beside dense Qwen3 stacks of the same
attention whose MLP is as large as the experts a step reads (8 x 768 at batch 1; at batch
B the distinct experts the B tokens chose, measured). Steps are interleaved round by round.
Printed per batch: step time, active and total bytes, the implied bandwidth, and the
ratio to the dense stack (about 1 when a step reads only the chosen experts).

With --gguf TYPE..., instead: the same layers as a GGUF file whose experts are of TYPE
(Q4_0, Q4_K, ...; one random expert's blocks repeated, which costs a step the bytes of
distinct ones; every other tensor F16), served with the experts kept quantized (the
default) and dequantized (--quantization none) from the same file. Printed per type and
batch: step times, the time in the expert layers, their ratio, and the experts' bytes as
held against their bytes in the file.

    .venv/bin/python bench/bench_moe.py [--layers 2] [--threads 1] [--dtype auto]
    .venv/bin/python bench/bench_moe.py --gguf Q4_0 Q4_K [--layers 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_decode import cpu_flags  # noqa: E402
from gateway.config import CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from gateway.models.info.gguf_file import GGUFFile  # noqa: E402
from gateway.models.layers.moe import FusedExperts, SparseMoE, route  # noqa: E402
from gateway.models.layers.quant_experts import QuantExperts  # noqa: E402
from gateway.platforms.cpu_isa import cpu_isa  # noqa: E402
from gateway.sampling_params import SamplingParams  # noqa: E402
from gateway.worker.worker import Worker  # noqa: E402
from tests.step_driver import StepDriver  # noqa: E402
from tests.tiny_model import _write_tokenizer  # noqa: E402

HIDDEN, EXPERTS, TOP_K, EXPERT_SIZE = 2048, 128, 8, 768
HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
Step = Callable[[], None]


def write_stack(folder: Path, layers: int, dtype: torch.dtype, inner: int | None) -> Path:
    """An HF folder of random weights: Qwen3-30B-A3B's layers (`inner` None) or a dense
    Qwen3 of the same attention with MLP size `inner`."""
    folder.mkdir(parents=True)
    vocab = _write_tokenizer(folder, 512)
    moe = inner is None
    config = {"architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
              "model_type": "qwen3_moe" if moe else "qwen3", "vocab_size": vocab,
              "hidden_size": HIDDEN, "intermediate_size": inner or 6144,
              "num_hidden_layers": layers, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    if moe:
        config |= {"num_experts": EXPERTS, "num_experts_per_tok": TOP_K,
                   "moe_intermediate_size": EXPERT_SIZE, "norm_topk_prob": True}
    (folder / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * shape[-1] ** -0.5).to(dtype)

    weights = {"model.embed_tokens.weight": rand(vocab, HIDDEN),
               "lm_head.weight": rand(vocab, HIDDEN),
               "model.norm.weight": torch.ones(HIDDEN, dtype=dtype)}
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        weights |= {f"{prefix}.input_layernorm.weight": torch.ones(HIDDEN, dtype=dtype),
                    f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=dtype),
                    f"{prefix}.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
                    f"{prefix}.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
                    f"{prefix}.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
                    f"{prefix}.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
                    f"{prefix}.self_attn.q_norm.weight": torch.ones(HEAD_DIM, dtype=dtype),
                    f"{prefix}.self_attn.k_norm.weight": torch.ones(HEAD_DIM, dtype=dtype)}
        if moe:
            weights[f"{prefix}.mlp.gate.weight"] = rand(EXPERTS, HIDDEN)
            for e in range(EXPERTS):
                weights |= {f"{prefix}.mlp.experts.{e}.gate_proj.weight": rand(EXPERT_SIZE, HIDDEN),
                            f"{prefix}.mlp.experts.{e}.up_proj.weight": rand(EXPERT_SIZE, HIDDEN),
                            f"{prefix}.mlp.experts.{e}.down_proj.weight": rand(HIDDEN, EXPERT_SIZE)}
        else:
            weights |= {f"{prefix}.mlp.gate_proj.weight": rand(inner, HIDDEN),
                        f"{prefix}.mlp.up_proj.weight": rand(inner, HIDDEN),
                        f"{prefix}.mlp.down_proj.weight": rand(HIDDEN, inner)}
    from safetensors.torch import save_file
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def write_gguf_stack(path: Path, layers: int, qtype: gguf.GGMLQuantizationType) -> Path:
    """A qwen3moe GGUF of Qwen3-30B-A3B's layers: the expert stacks of `qtype` (one random
    expert's blocks repeated), every other tensor F16 (norms F32)."""
    from tests.models.gguf_weights import BLOCK_KEPT, quantize_blocks
    from tests.models.tiny_gguf import _add_tokenizer

    (path.parent / "tokenizer").mkdir()
    vocab = _write_tokenizer(path.parent / "tokenizer", 512)
    generator = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 4096),
                       (writer.add_embedding_length, HIDDEN),
                       (writer.add_feed_forward_length, 6144), (writer.add_head_count, HEADS),
                       (writer.add_head_count_kv, KV_HEADS), (writer.add_key_length, HEAD_DIM),
                       (writer.add_value_length, HEAD_DIM), (writer.add_expert_count, EXPERTS),
                       (writer.add_expert_used_count, TOP_K),
                       (writer.add_expert_feed_forward_length, EXPERT_SIZE),
                       (writer.add_vocab_size, vocab)):
        add(value)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    _add_tokenizer(writer, path.parent / "tokenizer", "qwen2")

    def dense(*shape: int) -> np.ndarray:
        return (generator.standard_normal(shape, dtype=np.float32)
                * shape[-1] ** -0.5).astype(np.float16)

    def stack(rows: int, cols: int) -> np.ndarray:
        values = generator.standard_normal((rows, cols), dtype=np.float32) * cols ** -0.5
        blocks = quantize_blocks(values, qtype) if qtype in BLOCK_KEPT \
            else gguf.quants.quantize(values, qtype)
        return np.broadcast_to(blocks, (EXPERTS, *blocks.shape))

    ones = np.ones(HIDDEN, dtype=np.float32)
    tensors = {"token_embd.weight": dense(vocab, HIDDEN), "output.weight": dense(vocab, HIDDEN),
               "output_norm.weight": ones}
    for layer in range(layers):
        tensors |= {f"blk.{layer}.{name}.weight": array for name, array in {
            "attn_norm": ones, "ffn_norm": ones, "attn_q": dense(HEADS * HEAD_DIM, HIDDEN),
            "attn_k": dense(KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_v": dense(KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_output": dense(HIDDEN, HEADS * HEAD_DIM),
            "attn_q_norm": np.ones(HEAD_DIM, dtype=np.float32),
            "attn_k_norm": np.ones(HEAD_DIM, dtype=np.float32),
            "ffn_gate_inp": dense(EXPERTS, HIDDEN),
            "ffn_gate_exps": stack(EXPERT_SIZE, HIDDEN), "ffn_up_exps": stack(EXPERT_SIZE, HIDDEN),
            "ffn_down_exps": stack(HIDDEN, EXPERT_SIZE)}.items()}
    for name, array in tensors.items():
        if name.endswith("_exps.weight"):
            writer.add_tensor(name, np.ascontiguousarray(array), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def decoder(folder: Path, dtype: str, batch: int,
            quantization: str | None = None) -> tuple[Step, Worker]:
    """A worker on `folder` with `batch` sequences prefilled; each call decodes them."""
    worker = Worker(EngineConfig(model=ModelConfig(model=str(folder), dtype=dtype,
                                                   quantization=quantization),
                                 cache=CacheConfig(kv_cache_memory_gib=0.25)))
    worker.init_device()
    worker.load_model()
    driver = StepDriver(worker, worker.initialize_kv_cache())
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1_000_000)
    for i in range(batch):
        driver.add(f"r{i}", list(range(10 + i, 74 + i)), params)
    driver.step(budget=64 * batch)  # the prefills
    return driver.step, worker


class ExpertCount:
    """Distinct experts each MoE layer's router chose, per forward (a hook on the router)."""

    def __init__(self, worker: Worker) -> None:
        self.counts: list[int] = []
        model = worker.model_runner.model  # type: ignore[union-attr]
        for module in model.modules():
            if isinstance(module, SparseMoE):
                module.gate.register_forward_hook(self._hook)

    def _hook(self, _module: object, _inputs: object, logits: torch.Tensor) -> None:
        self.counts.append(int(route(logits, TOP_K, True)[1].unique().numel()))


class ExpertTime:
    """Time spent in the expert layers (hooks around each SparseMoE's experts), by `clock`."""

    def __init__(self, worker: Worker, clock: Callable[[], float]) -> None:
        self.total, self.clock, self.started = 0.0, clock, 0.0
        model = worker.model_runner.model  # type: ignore[union-attr]
        for module in model.modules():
            if isinstance(module, SparseMoE):
                module.experts.register_forward_pre_hook(self._start)
                module.experts.register_forward_hook(self._stop)

    def _start(self, *_: object) -> None:
        self.started = self.clock()

    def _stop(self, *_: object) -> None:
        self.total += self.clock() - self.started


def expert_bytes(worker: Worker) -> int:
    """Bytes of the worker's experts as held (quantized, or dense parameters)."""
    model = worker.model_runner.model  # type: ignore[union-attr]
    total = 0
    for module in model.modules():
        if isinstance(module, QuantExperts):
            total += module.num_bytes()
        elif isinstance(module, FusedExperts):
            total += sum(p.numel() * p.element_size() for p in module.parameters())
    return total


def compare_kept(args: argparse.Namespace, dtype: str, clock: Callable[[], float]) -> None:
    """Experts kept quantized against dequantized, from one GGUF file a type."""
    rows = []
    for name in args.gguf:
        qtype = gguf.GGMLQuantizationType[name]
        with tempfile.TemporaryDirectory(prefix="bench-moe-gguf-") as tmp:
            path = write_gguf_stack(Path(tmp) / f"stack-{name}.gguf", args.layers, qtype)
            file_bytes = sum(info.num_bytes for info in GGUFFile(path).tensors.values()
                             if info.name.endswith("_exps.weight"))
            for batch in args.batches:
                steps, spent, held = {}, {}, {}
                for variant, quantization in (("kept", None), ("dequantized", "none")):
                    step, worker = decoder(path, dtype, batch, quantization)
                    steps[variant], spent[variant] = step, ExpertTime(worker, clock)
                    held[variant] = expert_bytes(worker)
                torch.set_num_threads(args.threads)  # after the workers, which set their own
                measure(steps, 2, clock)  # warm-up
                for timer in spent.values():
                    timer.total = 0.0
                times = measure(steps, args.rounds, clock)
                experts = {variant: timer.total / args.rounds for variant, timer in spent.items()}
                rows.append((name, batch, times, experts, held, file_bytes, os.getloadavg()[0]))
                del steps, spent, step, worker
    print(f"\n{args.layers} layers; experts kept quantized (kept) or dequantized to {dtype} "
          f"(deq) from the same file; expert ms: the time inside the expert layers")
    print(f"{'type':>5}{'batch':>6}{'kept ms':>9}{'deq ms':>8}{'ratio':>7}{'kept exp ms':>12}"
          f"{'deq exp ms':>11}{'exp ratio':>10}{'held MB':>9}{'file MB':>9}{'held/file':>10}"
          f"{'load':>6}")
    for name, batch, times, experts, held, file_bytes, load in rows:
        print(f"{name:>5}{batch:>6}{1000 * times['kept']:>9.2f}{1000 * times['dequantized']:>8.2f}"
              f"{times['kept'] / times['dequantized']:>7.2f}{1000 * experts['kept']:>12.2f}"
              f"{1000 * experts['dequantized']:>11.2f}"
              f"{experts['kept'] / experts['dequantized']:>10.2f}{held['kept'] / 1e6:>9.1f}"
              f"{file_bytes / 1e6:>9.1f}{held['kept'] / file_bytes:>10.3f}{load:>6.1f}")
    print("ratio: kept over dequantized (below 1: the kept experts are faster); held/file: "
          "the experts' bytes as held over their bytes in the file")


def layer_bytes(size: int) -> tuple[int, int]:
    """(attention, norms and router bytes of one layer, one expert's bytes), elements of
    `size` bytes."""
    attention = (HEADS + 2 * KV_HEADS) * HEAD_DIM * HIDDEN + HIDDEN * HEADS * HEAD_DIM
    return (attention + EXPERTS * HIDDEN + 2 * HIDDEN + 2 * HEAD_DIM) * size, \
        3 * EXPERT_SIZE * HIDDEN * size


def measure(steps: dict[str, Step], rounds: int, clock: Callable[[], float]
            ) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = clock()
            step()
            times[name].append(clock() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU "
                        "computes it natively (AVX512-BF16 or AMX), else float32")
    parser.add_argument("--gguf", nargs="+", metavar="TYPE", help="compare the experts of "
                        "a GGUF of these types kept quantized and dequantized instead")
    args = parser.parse_args()
    dtype = args.dtype if args.dtype != "auto" else \
        "bfloat16" if cpu_isa().has_native_bf16 else "float32"
    torch_dtype = getattr(torch, dtype)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"CPU: {cpu_flags()}; dtype {dtype}; torch threads {args.threads}; clock "
          f"{'thread CPU time' if args.threads == 1 else 'wall'}")
    if args.gguf:
        compare_kept(args, dtype, clock)
        return
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        moe_folder = write_stack(Path(tmp) / "moe", args.layers, torch_dtype, None)
        rows = []
        for batch in args.batches:
            moe_step, moe_worker = decoder(moe_folder, dtype, batch)
            counter = ExpertCount(moe_worker)
            torch.set_num_threads(args.threads)
            for _ in range(3):
                moe_step()
            distinct = round(statistics.mean(counter.counts))
            dense_folder = write_stack(Path(tmp) / f"dense{batch}", args.layers, torch_dtype,
                                       distinct * EXPERT_SIZE)
            dense_step, _ = decoder(dense_folder, dtype, batch)
            torch.set_num_threads(args.threads)  # after the workers, which set their own
            measure({"moe": moe_step, "dense": dense_step}, 2, clock)  # warm-up
            load = os.getloadavg()[0]
            times = measure({"moe": moe_step, "dense": dense_step}, args.rounds, clock)
            shared, expert = layer_bytes(torch_dtype.itemsize)
            active = args.layers * (shared + distinct * expert)
            total = args.layers * (shared + EXPERTS * expert)
            rows.append((batch, distinct, times, active, total, load))
            del moe_worker, moe_step
    print(f"\n{args.layers} layers; bytes of the layer stack (attention, norms, router, "
          f"experts; the 512-token embedding and head left out)")
    print(f"{'batch':>5}{'experts/layer':>14}{'moe ms':>9}{'dense ms':>10}{'active MB':>11}"
          f"{'total MB':>10}{'active GB/s':>12}{'total GB/s':>11}{'moe/dense':>10}{'load':>6}")
    for batch, distinct, times, active, total, load in rows:
        moe_s, dense_s = times["moe"], times["dense"]
        print(f"{batch:>5}{distinct:>14}{1000 * moe_s:>9.2f}{1000 * dense_s:>10.2f}"
              f"{active / 1e6:>11.1f}{total / 1e6:>10.1f}{active / moe_s / 1e9:>12.2f}"
              f"{total / moe_s / 1e9:>11.2f}{moe_s / dense_s:>10.2f}{load:>6.1f}")
    print("moe/dense: the MoE step against a dense stack as large as the experts it read "
          "(1.0: it costs its active bytes; total/active would be the cost of reading "
          "every expert)")


if __name__ == "__main__":
    main()
