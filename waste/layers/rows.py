"""A per-sequence cache that grows by rows, appended without copying what is already there.

`append` returns a new Rows and leaves the old one as it was, so the layers stay pure functions of their inputs;
underneath, both share one buffer that doubles when full. A decode step then writes its row instead of copying
the whole cache (what torch.cat per step did: O(context) bytes per layer per token). Appending twice to the same
Rows (a branch) copies, so that neither sees the other's rows.
"""
from __future__ import annotations

import torch


class _Buffer:
    __slots__ = ("t", "filled")

    def __init__(self, t: torch.Tensor, filled: int):
        self.t, self.filled = t, filled


class Rows:
    __slots__ = ("_b", "n")

    def __init__(self, t: torch.Tensor, capacity: int = 0):
        """t: the first rows; capacity: rows to allocate at once (the planned context), so that a sequence within
        it never reallocates (static state: what `waste plan` counts is what is allocated)."""
        if capacity > t.shape[0]:
            # written once now (not calloc's lazy zero pages): the memory is taken at the start, as planned, not
            # when a long reply reaches it
            buf = torch.empty((capacity, *t.shape[1:]), dtype=t.dtype, device=t.device).zero_()
            buf[:t.shape[0]] = t
            t = buf[:t.shape[0]]
            self._b = _Buffer(buf, t.shape[0])
        else:
            self._b = _Buffer(t, t.shape[0])
        self.n = t.shape[0]

    @property
    def data(self) -> torch.Tensor:
        """The rows, a view of the shared buffer: later appends write past them, never over them."""
        return self._b.t[:self.n]

    def append(self, x: torch.Tensor) -> "Rows":
        buf, out = self.claim(x.shape[0], x.dtype)
        buf[self.n:out.n] = x
        return out

    def claim(self, T: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, "Rows"]:
        """(the whole buffer, a Rows of T more rows) for a kernel that writes rows n .. n + T - 1 of the buffer
        itself (layers/attention_cpu.py); append is claim and a copy."""
        b = self._b
        dtype = dtype or b.t.dtype
        if self.n != b.filled or self.n + T > b.t.shape[0] or dtype != b.t.dtype:
            cap = max(2 * b.t.shape[0], self.n + T, 16)
            t = torch.empty((cap, *b.t.shape[1:]), dtype=dtype, device=b.t.device)
            t[:self.n] = self.data
            b = _Buffer(t, self.n)
        b.filled = self.n + T
        out = Rows.__new__(Rows)
        out._b, out.n = b, self.n + T
        return b.t, out

    def can_put(self, T: int) -> bool:
        """Whether put() of T rows writes into this buffer (no branch, room left): a CUDA graph's fixed address."""
        return self.n == self._b.filled and self.n + T <= self._b.t.shape[0]

    def put(self, x: torch.Tensor, at: torch.Tensor) -> "Rows":
        """append() with the position given as a tensor [T] on the buffer's device (a CUDA graph replays it at
        each step's position); the caller checked can_put. The whole buffer stays addressable through `buffer`."""
        self._b.t.index_copy_(0, at, x)
        return self.advance(x.shape[0])

    def advance(self, T: int) -> "Rows":
        """The Rows T rows longer, their rows already written in the buffer (by a replayed put)."""
        self._b.filled = self.n + T
        out = Rows.__new__(Rows)
        out._b, out.n = self._b, self.n + T
        return out

    @property
    def buffer(self) -> torch.Tensor:
        return self._b.t

    def reset(self) -> "Rows":
        """No rows, over the same buffer (a finished sequence's state reused for the next one: its memory was
        allocated and touched once, at the planned context). Earlier versions of this Rows must not be read after."""
        self._b.filled = 0
        out = Rows.__new__(Rows)
        out._b, out.n = self._b, 0
        return out

    def __len__(self) -> int:
        return self.n
