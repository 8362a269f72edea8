"""What bench_gpu.py's phases share: the plan of a run (model shapes, loads, time boxes; one
for the GPU, a tiny one for the CPU dry run), the prompts, and the record each phase's child
process writes as it goes (so a phase killed at its time box still leaves what it measured).
No torch here: the orchestrator and the serving phase import this module."""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The two models' shapes (transformers LlamaConfig fields), on the GPU: Llama-3.2-1B's
# layers with SmolLM2's vocabulary (untied head: 1.17 B parameters), and SmolLM2-135M.
GPU_SHAPES: dict[str, dict[str, Any]] = {
    "llama1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 49152,
                "tie_word_embeddings": False, "rope_theta": 500000.0,
                "max_position_embeddings": 8192, "rms_norm_eps": 1e-5},
    "smollm2": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
                "tie_word_embeddings": True, "rope_theta": 100000.0,
                "max_position_embeddings": 8192, "rms_norm_eps": 1e-5},
}
# The dry run's stand-ins: the same vocabulary (the same tokenizer), a few narrow layers.
TINY_SHAPES: dict[str, dict[str, Any]] = {
    "llama1b": {**GPU_SHAPES["llama1b"], "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128},
    "smollm2": {**GPU_SHAPES["smollm2"], "hidden_size": 48, "num_hidden_layers": 3,
                "num_attention_heads": 3, "num_key_value_heads": 1, "intermediate_size": 96},
}
SERVED_NAME = "bench"


@dataclass
class Plan:
    """Every knob of one run."""

    dry_run: bool
    shapes: dict[str, dict[str, Any]]
    serve_args: list[str]
    prompt_len: int = 128
    output_len: int = 128
    concurrencies: list[int] = field(default_factory=lambda: [1, 32, 128])
    requests_per_client: dict[str, int] = field(
        default_factory=lambda: {"1": 5, "32": 2, "128": 2})
    clients_per_process: int = 16  # streaming clients per client process
    warmup_tokens: int = 8
    greedy_prompts: int = 4
    greedy_prompt_len: int = 32
    greedy_tokens: int = 32
    hf_batches: list[int] = field(default_factory=lambda: [1, 32])
    profile_batches: list[int] = field(default_factory=lambda: [1, 32])
    profile_steps: int = 5
    timed_steps: int = 20
    copy_bytes: int = 1 << 30
    fp32_equality: bool = True  # serve the SmolLM2 shape once more in float32
    # seconds each phase may take at most (the run's budget caps them too)
    boxes: dict[str, float] = field(default_factory=lambda: {
        "models": 75, "serve-llama1b": 110, "serve-smollm2": 70, "transformers": 60,
        "equality-fp32": 35, "profile": 45})
    budget_s: float = 420

    @classmethod
    def for_gpu(cls, serve_args: list[str]) -> Plan:
        return cls(dry_run=False, shapes=GPU_SHAPES, serve_args=serve_args)

    @classmethod
    def for_dry_run(cls, serve_args: list[str]) -> Plan:
        """The same pipeline on the CPU, small enough for well under a minute."""
        return cls(dry_run=True, shapes=TINY_SHAPES, serve_args=serve_args, prompt_len=16,
                   output_len=16, concurrencies=[1, 2, 4],
                   requests_per_client={"1": 2, "2": 1, "4": 1}, clients_per_process=2,
                   warmup_tokens=2, greedy_prompts=2, greedy_prompt_len=8, greedy_tokens=8,
                   hf_batches=[1, 4], profile_batches=[1, 4], profile_steps=3, timed_steps=5,
                   copy_bytes=1 << 26, fp32_equality=False,
                   boxes={"models": 60, "serve-llama1b": 60, "serve-smollm2": 60,
                          "transformers": 60, "equality-fp32": 60, "profile": 60},
                   budget_s=240)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def served_dtype(self) -> str | None:
        """The --dtype the server flags ask for (None: auto)."""
        args = self.serve_args
        for i, arg in enumerate(args):
            if arg == "--dtype" and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith("--dtype="):
                return arg.split("=", 1)[1]
        return None


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` token ids drawn from the vocabulary's ordinary tokens
    (its first 100, the special ones among them, left out)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(count)]


GREEDY_SEED = 7  # the greedy-equality prompts' seed: the server and transformers see the same


class Record:
    """A phase's results, rewritten (atomically) at every `set`, so that whatever a killed
    phase measured survives it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        write_json(self.path, self.data)

    def section(self, *keys: str) -> dict[str, Any]:
        """The nested dict at data[keys[0]][keys[1]]..., made where missing."""
        node = self.data
        for key in keys:
            node = node.setdefault(key, {})
        return node

    def save(self) -> None:
        write_json(self.path, self.data)


def write_json(path: Path, data: Any) -> None:
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(data, indent=1, default=str))
    os.replace(temporary, path)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def error_text(error: BaseException) -> str:
    """The exception first (its type and message: a report shows this line), then where it
    was raised (the last frames of its traceback)."""
    frames = traceback.format_exception(error)
    where = "".join(frames[-3:-1]).strip()[-1000:]
    return f"{type(error).__name__}: {error}"[:2000] + "\n" + where


def measured(record: Record, keys: tuple[str, ...], work: Callable[..., Any],
             *args: Any) -> Any:
    """Run one part of a phase, `work(*args)`: a dict it returns is stored at `keys`; a
    failure is stored there as {"error": ...}, and the phase goes on with its next part."""
    try:
        result = work(*args)
    except Exception as error:  # one part's failure must not end the phase
        print(f"  {'/'.join(keys)}: FAILED: {error!r}", flush=True)
        record.section(*keys)["error"] = error_text(error)
        record.save()
        return None
    if isinstance(result, dict):
        record.section(*keys).update(result)
        record.save()
    return result


@dataclass
class PhaseArgs:
    """What the orchestrator hands a phase's child process (as JSON)."""

    phase: str
    plan: Plan
    state: Path  # the phase writes state/PHASE.json
    out: Path  # logs go here
    work: Path  # the models' folders
    deadline: float  # time.time() by which the phase must be done
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def result_path(self) -> Path:
        return self.state / f"{self.phase}.json"

    def seconds_left(self) -> float:
        return self.deadline - time.time()

    def dump(self, path: Path) -> None:
        write_json(path, {"phase": self.phase, "plan": self.plan.to_dict(),
                          "state": str(self.state), "out": str(self.out),
                          "work": str(self.work), "deadline": self.deadline,
                          "extra": self.extra})

    @classmethod
    def load(cls, path: Path) -> PhaseArgs:
        data = json.loads(path.read_text())
        return cls(phase=data["phase"], plan=Plan.from_dict(data["plan"]),
                   state=Path(data["state"]), out=Path(data["out"]), work=Path(data["work"]),
                   deadline=data["deadline"], extra=data["extra"])


def child_main(phases: dict[str, Callable[[PhaseArgs, Record], None]],
               preload: Callable[[str], None] | None = None) -> None:
    """A phase child's entry: `python -m bench.MODULE ARGS.json`, or, started ahead of its
    phase, `python -m bench.MODULE --ahead KIND`: it imports what phases of KIND need
    (`preload`) while the phase before runs, then reads its ARGS.json path from stdin (an
    empty line or end of file: not needed, it exits)."""
    if sys.argv[1] == "--ahead":
        if preload is not None:
            preload(sys.argv[2])
        path = sys.stdin.readline().strip()
        if not path:
            return
    else:
        path = sys.argv[1]
    args = PhaseArgs.load(Path(path))
    record = Record(args.result_path)
    try:
        phases[args.extra["kind"]](args, record)
    except Exception as error:
        record.set("error", error_text(error))
        raise


def model_folder(work: Path, name: str) -> Path:
    return work / name
