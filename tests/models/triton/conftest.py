"""The Triton kernels run on the CPU through Triton's interpreter where there is no CUDA
device (on one, they are compiled for it and the same tests check them there).
TRITON_INTERPRET must be set before the kernels are defined, when their modules are first
imported during collection, so it is set here, at import, for the rest of the session."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
