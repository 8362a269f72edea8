"""Pooling parameters: how an embedding request pools, shared by every process.

Like `SamplingParams`, plain data that travels as msgpack from the front end to the engine
core and the workers.
"""

from __future__ import annotations

import msgspec


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One pooling request. The pooling method itself (mean, CLS, last token) is the
    model's, read from its config; a request can only ask for less."""

    task: str = "embed"
    #: L2-normalise the pooled vector; None: the model's own choice (its config's
    #: Normalize module, else no).
    normalize: bool | None = None
    #: Keep the first `dimensions` values (Matryoshka models only; the front end refuses
    #: it for the others); None: all of them.
    dimensions: int | None = None
