"""CUDA graphs for a decode step's MoE layers (`--device cuda`, every routed expert resident in GPU memory).

A MoE layer's MLP at one row (router, slot lookup, the expert kernels, the weighted sum, shared experts) has fixed
shapes and, once the expert store's whole bank sits in the GPU slab, no host sync (ExpertCache.device_map): it is
captured once per layer and replayed, one launch instead of its few dozen. Attention stays eager: its key length
grows each step. Anything that watches the step from the host (a benchmark's routing stand-in, route or predict
traces, the profiler's timer) or a store that still reads experts keeps the eager path.
"""
from __future__ import annotations

import dataclasses

import torch

from ..timing import NO_TIMER


class MlpGraphs:
    def __init__(self, model):
        self.model = model
        self.graphs: dict[int, tuple] = {}
        self.pool = None
        self.capturing = False

    def usable(self) -> bool:
        m = self.model
        if self.capturing or m.router is not None or m.route_trace is not None or m.predict_trace is not None \
                or m.timer is not NO_TIMER:
            return False
        dm = getattr(m.experts, "device_map", None)
        return dm is not None and dm() is not None

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        """Layer i's MoE MLP of one row x [1, h] by replaying its graph (captured on first use); None where the
        eager path must run."""
        if x.shape[0] != 1 or not self.usable():
            return None
        g = self.graphs.get(i)
        if g is None:
            g = self.graphs[i] = self._capture(i, x)
        gx, gy, graph = g
        gx.copy_(x)
        graph.replay()
        self.model.experts.count_hits(i, self.model.top_k)
        return gy

    def _capture(self, i: int, x: torch.Tensor):
        m = self.model
        stats = m.experts.stats
        before = dataclasses.replace(stats, per_layer={k: list(v) for k, v in stats.per_layer.items()})
        gx = x.clone()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self.capturing = True
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):          # warm up off the capture: triton compiles, the allocator fills
                for _ in range(2):
                    m.mlp_many(i, [gx])
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                gy = m.mlp_many(i, [gx])[0]
        finally:
            self.capturing = False
            for f in dataclasses.fields(stats):     # the warm-up and capture calls are no tokens: not counted
                setattr(stats, f.name, getattr(before, f.name))
        return gx, gy, graph
