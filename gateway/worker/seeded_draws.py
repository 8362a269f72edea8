"""Per-request seeded uniforms for the sampler, every seeded row of a step at once (worker
process).

A seeded request's k-th draw is the k-th number `torch.rand(1, generator=g)` gives after
`g.manual_seed(seed)`: the k-th output of a Mersenne Twister (MT19937) seeded with the low
32 bits of the seed, its low 24 bits scaled to [0, 1). The twisters of all rows live in one
[rows, 624] array, so a step draws for every seeded row with a few numpy operations
instead of one generator call a row, and gives exactly the tokens torch's generators gave.
"""

from __future__ import annotations

import numpy as np

_N, _M = 624, 397
_MATRIX, _UPPER, _LOWER = np.uint32(0x9908B0DF), np.uint32(0x80000000), np.uint32(0x7FFFFFFF)
_SCALE = np.float32(2.0 ** -24)


class SeededDraws:
    """One MT19937 per persistent-batch row; rows without a seed hold stale state."""

    def __init__(self, rows: int = 0) -> None:
        self.state = np.zeros((rows, _N), dtype=np.uint32)
        self.uniforms = np.zeros((rows, _N), dtype=np.float32)  # the state's, tempered
        self.position = np.full(rows, _N, dtype=np.int64)  # next word; _N: twist first

    def seed(self, row: int, seed: int, skip: int = 0) -> None:
        """Start `row` from `seed` (any int; its low 32 bits count, as torch's), having
        already drawn `skip` numbers (a request re-added after a preemption)."""
        self._grow(row + 1)
        # numpy's legacy seeding of a 32-bit int is MT19937's own init_genrand.
        key = np.random.RandomState(seed & 0xFFFFFFFF).get_state(legacy=True)[1]  # type: ignore[index]
        self.state[row] = key
        self.position[row] = _N
        while skip > 0:
            if self.position[row] >= _N:
                self._twist(np.array([row]))
            taken = min(skip, _N - int(self.position[row]))
            self.position[row] += taken
            skip -= taken

    def move(self, source: int, target: int, swap: bool) -> None:
        self._grow(max(source, target) + 1)
        for column in (self.state, self.uniforms, self.position):
            if swap:
                column[[source, target]] = column[[target, source]]
            else:
                column[target] = column[source]

    def draw(self, rows: np.ndarray) -> np.ndarray:
        """The next uniform of each row in `rows` (distinct rows): float32 [len(rows)]."""
        positions = self.position[rows]
        spent = positions >= _N
        if spent.any():
            self._twist(rows[spent])
            positions = self.position[rows]
        self.position[rows] = positions + 1
        return self.uniforms[rows, positions]

    def draw_run(self, row: int, count: int) -> np.ndarray:
        """The next `count` uniforms of one row: what `torch.rand(count, generator=g)`
        gives (the row's stream shared by the unseeded requests)."""
        runs: list[np.ndarray] = []
        while count > 0 or not runs:
            if self.position[row] >= _N and count:
                self._twist(np.array([row]))
            start = int(self.position[row])
            taken = min(count, _N - start)
            runs.append(self.uniforms[row, start:start + taken].copy())
            self.position[row] += taken
            count -= taken
        return runs[0] if len(runs) == 1 else np.concatenate(runs)

    def _twist(self, rows: np.ndarray) -> None:
        _twist(self.state, rows)
        words = _temper(self.state[rows]) & np.uint32(0xFFFFFF)
        self.uniforms[rows] = words.astype(np.float32) * _SCALE
        self.position[rows] = 0

    def _grow(self, rows: int) -> None:
        if rows > len(self.position):
            grown = max(rows, 2 * len(self.position))
            state = np.zeros((grown, _N), dtype=np.uint32)
            state[:len(self.state)] = self.state
            uniforms = np.zeros((grown, _N), dtype=np.float32)
            uniforms[:len(self.uniforms)] = self.uniforms
            position = np.full(grown, _N, dtype=np.int64)
            position[:len(self.position)] = self.position
            self.state, self.uniforms, self.position = state, uniforms, position


def _twist(state: np.ndarray, rows: np.ndarray) -> None:
    """Regenerate the 624 words of `rows` (MT19937's twist, in the four slices whose
    inputs are ready: word i needs words i + 1 and i + 397 as they are when it is made)."""
    mt = state[rows]
    half = _N - _M  # 227
    for start, end, far in ((0, half, _M), (half, 2 * half, 0), (2 * half, _N - 1, half)):
        _twist_slice(mt, start, end, mt[:, start + 1:end + 1], mt[:, far:far + end - start])
    _twist_slice(mt, _N - 1, _N, mt[:, :1], mt[:, _M - 1:_M])
    state[rows] = mt


def _twist_slice(mt: np.ndarray, start: int, end: int, following: np.ndarray,
                 far: np.ndarray) -> None:
    y = (mt[:, start:end] & _UPPER) | (following & _LOWER)
    mt[:, start:end] = far ^ (y >> np.uint32(1)) ^ ((y & np.uint32(1)) * _MATRIX)


def _temper(y: np.ndarray) -> np.ndarray:
    y = y ^ (y >> np.uint32(11))
    y = y ^ ((y << np.uint32(7)) & np.uint32(0x9D2C5680))
    y = y ^ ((y << np.uint32(15)) & np.uint32(0xEFC60000))
    return y ^ (y >> np.uint32(18))
