"""What every executor answers (engine-core process), and the error of a dead one."""

from __future__ import annotations

from typing import Any, Protocol

from gateway.messages import ModelRunnerOutput, SchedulerOutput


class ExecutorDeadError(RuntimeError):
    """A worker died or failed a step: the engine core cannot go on. It is not caught per
    step; the engine core exits and the front end's engine-death path takes over."""


class Executor(Protocol):
    num_kv_blocks: int  # agreed by every rank

    @property
    def supported_tasks(self) -> tuple[str, ...]: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def eos_token_ids(self) -> list[int]: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def device_type(self) -> str:
        """The workers' torch device type: "cpu", "cuda"."""
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; the sampled tokens (rank 0's)."""
        ...

    def submit_step(self, scheduler_output: SchedulerOutput) -> None:
        """Start one step and return at once (--async-scheduling): the ranks run submitted
        steps in order, one at a time."""
        ...

    def take_step(self) -> ModelRunnerOutput:
        """The oldest submitted step's output, waiting for it; its error, if it failed."""
        ...

    def check_health(self) -> None:
        """Raise ExecutorDeadError when a worker is gone (called while idle)."""
        ...

    def plugin_reports(self) -> list[dict[str, Any]]:
        """The load-report records of the worker processes (none for `uni`)."""
        ...

    def shutdown(self) -> None: ...
