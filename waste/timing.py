"""Where a decode step's time goes (`waste bench --profile`): named sections timed exclusively (a section's time
excludes the sections opened inside it). Off by default: the model's `timer` is NO_TIMER, whose sections cost one
attribute lookup and an empty `with`."""
from __future__ import annotations

import contextlib
import time

BUCKETS = ("attention", "router", "expert compute", "expert wait", "trunk matvec", "sampling", "other")


class _Null:
    def section(self, name: str):
        return _NULL_CM


_NULL_CM = contextlib.nullcontext()
NO_TIMER = _Null()


class Timer:
    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._stack: list[list] = []          # [name, start, child seconds]

    @contextlib.contextmanager
    def section(self, name: str):
        frame = [name, time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            total = time.perf_counter() - frame[1]
            self.add(name, total - frame[2])
            if self._stack:
                self._stack[-1][2] += total

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def move(self, src: str, dst: str, seconds: float) -> None:
        """Count seconds already counted under src under dst instead (the expert wait inside the expert section)."""
        self.add(src, -seconds)
        self.add(dst, seconds)


def count_ops(fn) -> tuple[int, dict[str, int]]:
    """Run fn() and count the torch operators it dispatches (after torch's own decomposition of composite ops):
    the per-op overhead a decode step pays. Returns (total, per operator)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.by: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            self.by[name] = self.by.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with Count() as c:
        fn()
    return sum(c.by.values()), c.by
