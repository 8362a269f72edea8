"""Executor `uni`: one worker, inside the engine-core process. Under --async-scheduling
its steps run on a step thread, so the engine core schedules the next one meanwhile."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from gateway.config import EngineConfig
from gateway.messages import ModelRunnerOutput, SchedulerOutput


class UniExecutor:
    def __init__(self, config: EngineConfig) -> None:
        from gateway.worker.worker import Worker  # torch lives below this line

        self.worker = Worker(config, rank=0)
        self.worker.init_device()
        self.worker.load_model()
        self.num_kv_blocks = self.worker.initialize_kv_cache()
        self._step_thread: ThreadPoolExecutor | None = None  # started by the first submit
        self._submitted: deque[Future[ModelRunnerOutput]] = deque()

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return self.worker.supported_tasks

    @property
    def max_model_len(self) -> int:
        return self.worker.max_model_len

    @property
    def eos_token_ids(self) -> list[int]:
        return self.worker.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.worker.vocab_size

    @property
    def device_type(self) -> str:
        return self.worker.device_type

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def submit_step(self, scheduler_output: SchedulerOutput) -> None:
        if self._step_thread is None:  # one thread: the steps run in the order submitted
            self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="gateway-step")
        self._submitted.append(self._step_thread.submit(self.worker.execute_model,
                                                        scheduler_output))

    def take_step(self) -> ModelRunnerOutput:
        return self._submitted.popleft().result()

    def check_health(self) -> None:
        pass  # the worker is this process

    def plugin_reports(self) -> list[dict[str, Any]]:
        # The worker shares the engine core's process, so its records are the core's.
        return []

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True, cancel_futures=True)
