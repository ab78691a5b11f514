"""What every CUDA graph capture of the decode step needs (graphs.py, row_graphs.py)."""
from __future__ import annotations

import contextlib
import dataclasses
import gc

import torch


@contextlib.contextmanager
def no_collection():
    """No garbage collection during a capture: a CUDA graph of an engine gone (a cycle the collector frees)
    destroyed mid-capture invalidates the capture (seen on the H200); collected now, before it starts."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def counters_kept(stats):
    """A capture's warm-up and capture calls are no tokens: the store's counters are put back as they were."""
    before = dataclasses.replace(stats, per_layer={k: list(v) for k, v in stats.per_layer.items()})
    try:
        yield
    finally:
        for f in dataclasses.fields(stats):
            setattr(stats, f.name, getattr(before, f.name))


def capture_on_side(fn, pool=None):
    """fn run once on a side stream (compiles, the allocator), then captured (in `pool`, or a private one): (graph,
    its output). For an fn that is idempotent over its inputs (it writes what it reads from the same inputs), so the
    eager run leaves the buffers as one replay would."""
    with no_collection():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")   # (the store's threads make CUDA calls)
            try:
                out = fn()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
    return graph, out
