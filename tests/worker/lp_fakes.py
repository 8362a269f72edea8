"""Fake logits-processor plugins, written as real distributions by the tests that use them."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.plugins import LOGITS_PROCESSORS_GROUP
from tests.plugin_dists import activate, write_dist

FORCE_MODULE = "fake_lp_force"
FORCE_CLASS = f"{FORCE_MODULE}:ForceTokenProcessor"
BROKEN_MODULE = "fake_lp_broken"
MODULES = (FORCE_MODULE, BROKEN_MODULE)

FORCE_SOURCE = '''
import torch

from gateway.plugins.contracts import LogitsProcessor, MoveDirectionality


class ForceTokenProcessor(LogitsProcessor):
    """Forces extra_args["force_token"] for the requests that ask for it."""

    def __init__(self, config, device, is_pin_memory):
        super().__init__(config, device, is_pin_memory)
        self.forced = {}  # row -> token

    @classmethod
    def validate_params(cls, sampling_params):
        token = (sampling_params.extra_args or {}).get("force_token")
        if token is not None and (not isinstance(token, int) or token < 0):
            raise ValueError(f"force_token must be a non-negative integer, got {token!r}")

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.forced.pop(row, None)
        for row, params, _prompt, _output in batch_update.added:
            self.forced.pop(row, None)
            token = (params.extra_args or {}).get("force_token")
            if token is not None:
                self.forced[row] = token
        for source, target, direction in batch_update.moved:
            from_source, from_target = self.forced.pop(source, None), self.forced.pop(target, None)
            if from_source is not None:
                self.forced[target] = from_source
            if direction is MoveDirectionality.SWAP and from_target is not None:
                self.forced[source] = from_target

    def apply(self, logits):
        if self.forced:
            rows = torch.tensor(list(self.forced), device=logits.device)
            tokens = torch.tensor(list(self.forced.values()), device=logits.device)
            logits[rows] = float("-inf")
            logits[rows, tokens] = 0.0
        return logits
'''

BROKEN_SOURCE = '''
import torch

from gateway.plugins.contracts import LogitsProcessor


class _Base(LogitsProcessor):
    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        return logits


class RaisesInApply(_Base):
    def apply(self, logits):
        raise RuntimeError("boom in apply")


class RaisesInUpdateState(_Base):
    def update_state(self, batch_update):
        if batch_update is not None and batch_update.added:
            raise KeyError("boom in update_state")


class WrongShape(_Base):
    def apply(self, logits):
        return logits[:, :3]


class RaisesInInit(_Base):
    def __init__(self, config, device, is_pin_memory):
        raise OSError("no such device file")


class CountsCalls(_Base):
    """Argmax invariant: greedy-only steps may skip it."""

    calls = 0

    def is_argmax_invariant(self):
        return True

    def apply(self, logits):
        type(self).calls += 1
        return logits


class StrictParams(_Base):
    @classmethod
    def validate_params(cls, sampling_params):
        from gateway.sampling_params import InvalidParameterError
        if sampling_params.top_k == 7:
            raise InvalidParameterError("top_k", "top_k=7 is unlucky")


class NotAProcessor:
    pass

'''


def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            entry_points: dict[str, str] | None = None, dist_name: str = "fake-lp") -> None:
    """Write both fake modules, and `entry_points` ({name: "module:attr"}) in
    vllm.logits_processors, as distribution `dist_name`; put it on sys.path."""
    write_dist(tmp_path, dist_name, {LOGITS_PROCESSORS_GROUP: entry_points or {}},
               {FORCE_MODULE: FORCE_SOURCE, BROKEN_MODULE: BROKEN_SOURCE})
    activate(tmp_path, monkeypatch)
