"""Benchmark: model load time and resident memory per decoder family, the gateway's loader
against transformers' `from_pretrained`, measured in the same run.

Not a test. Each family's tiny random model (tests/tiny_model.py) and the default model
(SmolLM2-135M-Instruct's GGUF, dequantized to float32 on both sides) is loaded twice in a
fresh process per side, float32 on the CPU, after that process has imported torch and its
side's entry point: the first load ("cold": what a server start pays, lazy imports of the
model code included) and the second ("warm": the load alone, files in the page cache).
Memory: resident memory added by the first load (RSS after minus before) and its peak
(VmHWM minus RSS before). The ratios are ours / transformers' (below 1: ours is faster or
smaller).

    .venv/bin/python bench/bench_model_load.py              # every family's tiny model
    .venv/bin/python bench/bench_model_load.py --default    # and the default model
    .venv/bin/python bench/bench_model_load.py --families Qwen3ForCausalLM --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _child(side: str, model: str) -> None:
    """In a fresh process: load `model` once on `side` and print the figures as JSON."""
    import torch

    if side == "ours":
        from gateway.models.info.paths import read_model_info
        from gateway.models.loading.loader import load_model

        info = read_model_info(model)

        def load() -> object:
            return load_model(info, torch.device("cpu"), torch.float32, quantization="none")
    else:
        from transformers import AutoModelForCausalLM

        path = Path(model)
        kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        source = path.parent if kwargs else path

        def load() -> object:
            return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs)
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    first = load()
    cold = time.perf_counter() - start
    figures = {"cold_s": cold, "rss_mib": (_status_kib("VmRSS") - before) / 1024,
               "peak_mib": (_status_kib("VmHWM") - before) / 1024}
    del first
    start = time.perf_counter()
    load()
    print(json.dumps({**figures, "warm_s": time.perf_counter() - start}))


def _measure(side: str, model: Path, repeat: int) -> dict[str, float]:
    """The best of `repeat` fresh processes (the least disturbed by other load)."""
    runs = []
    for _ in range(repeat):
        result = subprocess.run([sys.executable, __file__, "--child", side, str(model)],
                                capture_output=True, text=True, check=True,
                                env={**os.environ, "GATEWAY_LOG_LEVEL": "WARNING"})
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    return {key: min(run[key] for run in runs) for key in runs[0]}


def _models(families: list[str], folder: Path, with_default: bool) -> dict[str, Path]:
    from tests.tiny_model import build_tiny_decoder, build_tiny_llama

    models = {}
    for family in families:
        models[family] = (build_tiny_llama(folder / family) if family == "LlamaForCausalLM"
                          else build_tiny_decoder(folder / family, family))
    if with_default:
        from gateway.models.info.paths import default_model_path

        models["default (SmolLM2-135M GGUF)"] = default_model_path()
    return models


def main() -> None:
    from tests.tiny_model import DECODER_FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*",
                        default=["LlamaForCausalLM", *sorted(DECODER_FAMILIES)])
    parser.add_argument("--default", action="store_true",
                        help="add the default model (transformers' GGUF loader failed on its "
                             "Q4_1 file when this was written)")
    parser.add_argument("--repeat", type=int, default=1, help="processes per side (best kept)")
    args = parser.parse_args()
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"dtype float32; the best of {args.repeat} process(es) per side")
    print(f"{'model':30} {'side':6} {'cold s':>8} {'warm s':>8} {'RSS MiB':>8} {'peak MiB':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in _models(args.families, Path(tmp), args.default).items():
            ours, theirs = (_measure(side, path, args.repeat) for side in ("ours", "hf"))
            for side, figures in (("ours", ours), ("hf", theirs)):
                print(f"{name:30} {side:6} {figures['cold_s']:8.3f} {figures['warm_s']:8.3f} "
                      f"{figures['rss_mib']:8.1f} {figures['peak_mib']:9.1f}")
            print(f"{name:30} ratio  {_ratio(ours, theirs, 'cold_s')} cold, "
                  f"{_ratio(ours, theirs, 'warm_s')} warm, {_ratio(ours, theirs, 'peak_mib')} "
                  f"peak memory")


def _ratio(ours: dict[str, float], theirs: dict[str, float], key: str) -> str:
    return f"{ours[key] / theirs[key]:.2f}x" if theirs[key] > 1e-3 else "n/a"


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
    else:
        main()
