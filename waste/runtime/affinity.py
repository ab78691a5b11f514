"""Where a streamed CPU decode step's threads run: the decoding thread and each expert pool thread on a CPU of its
own, while the step runs. Left to the scheduler, a pool thread that the decoding thread woke (the q8 rows' helper,
the next pair) was often put on the waker's CPU and waited for it to block: with the reads queued by Linux AIO the
helper started 0.46 ms late (median) against 0.07 pinned, and attention took 1.8 ms a layer against 1.4
(docs/LEARNED.md §3p). Only where every thread gets a CPU of the process's own; elsewhere nothing is pinned."""
from __future__ import annotations

import contextlib
import itertools
import os


def usable_cpus() -> list[int]:
    """The CPUs this thread may run on, ascending ([] where the platform does not say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def pool_pinner(threads: int):
    """A thread pool initializer for the expert pool's `threads` workers: worker i (in start order) on the process's
    CPU i + 1, the first left to the decoding thread (decoding_cpu); None where there are fewer CPUs than
    threads + 1."""
    cpus = usable_cpus()
    if len(cpus) < threads + 1:
        return None
    nth = itertools.count(1)

    def pin() -> None:
        i = next(nth)
        if i < len(cpus):
            os.sched_setaffinity(0, {cpus[i]})
    return pin


def unpinned(cpus: list[int]):
    """A thread pool initializer giving its workers `cpus` (the process's, taken when the pool was made): a worker
    started inside a pinned step would otherwise inherit the decoding thread's one CPU."""
    def widen() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
    return widen


@contextlib.contextmanager
def decoding_cpu(threads: int):
    """This thread on the first of the process's CPUs for the block, where there is one for each of `threads`
    (it and the expert pool's), then back to the CPUs it had."""
    cpus = usable_cpus()
    if len(cpus) < threads:
        yield
        return
    os.sched_setaffinity(0, {cpus[0]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cpus)
