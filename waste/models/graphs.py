"""CUDA graphs for the decode step (`--device cuda`, every routed expert resident in GPU memory).

Once the expert store's whole bank sits in the GPU slab, a MoE layer needs no host sync (ExpertCache.device_map:
slots looked up on the GPU), so a one-row decode step has fixed shapes except for attention's growing key length.
- Whole step: where the family's attention has a fixed-shape form (`graph_state`: Qwen3's GQA), one sequence's
  decode step is captured once per (sequence buffers, key bucket) and replayed: the token and the position are
  copied into the graph's inputs, the cache row is put at the position, attention reads the first L rows of the
  cache buffer (L the position rounded up to BUCKET rows) with the rows past the position masked.
- MoE layers only: elsewhere (other families, or a step the whole-step graph cannot take) each MoE layer's one-row
  MLP is captured once and replayed; attention stays eager, except where a layer's state has fixed shapes (KDA's:
  the family's `fixed_state`): that whole layer's one-row step is captured and replayed (docs/LEARNED.md §10i).
- Cut at the MoE layers (a store that still reads experts: the disk or host tier): the same fixed-shape step is
  captured as a chain of graphs, one from the step's start to the first MoE layer's MLP input, one between each
  MoE layer and the next, one to the logits. Replayed in order, each MoE layer's MLP runs eagerly between two of
  them (its ids go to the host, its misses are read and land group by group) and writes its output into a buffer
  the next graph reads. The graphs share one pool and are replayed in capture order, so a tensor live across a cut
  (the residual stream, the MLP's input) keeps its address (docs/LEARNED.md §10n).
- A MoE layer's experts group by group: where its MLP runs eagerly for one row (between cut graphs, or in an eager
  step), each group of its experts that lands is computed by replaying a graph of that layer (row_graphs.py).
Anything that watches the step from the host (a benchmark's routing stand-in, route or predict traces, the
profiler's timer) or a batch of sequences keeps the eager path.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from ..timing import NO_TIMER
from .capture import counters_kept, no_collection
from .row_graphs import RowGroups

BUCKET = 256          # key rows a captured step attends over come in multiples of this
MAX_STEP_GRAPHS = 8   # captured whole steps kept (least recently used dropped): sequences x buckets


class DecodeGraphs:
    def __init__(self, model, base_mlp):
        self._model = weakref.ref(model)      # no cycle with the model: its graphs are freed when it is
        self._base_mlp = base_mlp             # DecoderModel.mlp_many (unbound): what a MoE layer's graph captures
        self.mlps: dict[int, tuple] = {}
        self.layers: dict[int, tuple] = {}
        self.steps: OrderedDict = OrderedDict()
        self.pool = None
        self.capturing = False
        self.whole = True               # whole-step graphs where the family allows (the benchmark turns them off)
        self.layers_on = True           # whole layers' graphs where the state allows (the benchmark turns them off)
        self.cut_on = True              # steps cut at the MoE layers where experts stream (the benchmark's arm)
        self.cutting = None             # inside a cut step's warm-up ("warm") or capture ("capture"): see cut()
        self._open = None               # the graph being captured between two cuts
        self._outer = None              # the stream a cut step's capture was started from (its buffers' stream)
        self._cuts: list = []
        self._segs: list = []
        self.rows = RowGroups()         # a row's expert groups as graphs where the MLP runs eagerly (row_graphs.py)

    @property
    def model(self):
        return self._model()

    def watched(self) -> bool:
        """Whether something reads the step from the host (or a capture is under way): no graph then."""
        m = self.model
        return self.capturing or m.router is not None or m.route_trace is not None or m.predict_trace is not None \
            or m.timer is not NO_TIMER

    def usable(self) -> bool:
        if self.watched():
            return False
        dm = getattr(self.model.experts, "device_map", None)
        return dm is not None and dm() is not None

    def cut_usable(self) -> bool:
        """A step whose experts stream can be replayed as graphs cut at its MoE layers: the base MLP (a family's
        own additions around it would fall inside a graph), one process's store (expert parallel exchanges rows)."""
        m = self.model
        return self.cut_on and not self.watched() and type(m).mlp_many is self._base_mlp \
            and not hasattr(m.experts, "exchange") and getattr(m.experts, "device_map", None) is not None

    def row_groups(self, xs: list, bank, kernel) -> RowGroups | None:
        """The row-group graphs for an eager MoE MLP of one decode row, or None: outside any capture or cut warm-up
        (there the calls are recorded into the step's graphs, or run as they will be replayed)."""
        if len(xs) != 1 or not xs[0].is_cuda or self.capturing or self.cutting:
            return None
        return self.rows if self.rows.serves(xs[0], bank, kernel) else None

    def _capture(self, fn, stats_from):
        """Warm fn up on a side stream (triton compiles, the allocator fills), then capture it: (graph, output).
        The warm-up and capture calls are no tokens: the store's counters are put back as they were."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self.capturing = True
        try:
            with counters_kept(stats_from.stats), no_collection():
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        fn()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = fn()
        finally:
            self.capturing = False
        return graph, out

    # -- one MoE layer's MLP -----------------------------------------------------------------------
    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        """Layer i's MoE MLP of one row x [1, h] by replaying its graph (captured on first use); None where the
        eager path must run."""
        if x.shape[0] != 1 or not self.usable():
            return None
        g = self.mlps.get(i)
        if g is None:
            gx = x.clone()
            # the base's MLP, which is what returns the replay: a family's own additions (Qwen3-Next's gated
            # shared expert) run after it, eagerly, as they do around the eager path
            graph, gy = self._capture(lambda: self._base_mlp(self.model, i, [gx])[0], self.model.experts)
            g = self.mlps[i] = (gx, gy, graph)
        gx, gy, graph = g
        gx.copy_(x)
        graph.replay()
        self.model.experts.count_hits(i, self.model.top_k)
        return gy

    # -- a whole layer of fixed-shape state -------------------------------------------------------
    def layer(self, i: int, h: torch.Tensor, state) -> tuple | None:
        """Layer i over one sequence's one row by replaying its graph (captured on first use), where the family
        gives the layer's state as fixed-shape tensors (`fixed_state`: KDA's): (h', the new state); None where the
        eager path must run. The state is copied into the graph's inputs and the outputs copied out, so states stay
        values (a sequence's state is never the graph's buffers, whatever is batched or interleaved)."""
        m = self.model
        fixed = m.fixed_state(i, state) if self.layers_on else None
        if fixed is None or not isinstance(h, torch.Tensor) or h.shape[0] != 1 or not self.usable():
            return None
        ins, rebuild = fixed
        g = self.layers.get(i)
        if g is None or g[0].dtype != h.dtype or g[0].shape != h.shape:
            gh, gin = h.clone(), [t.clone() for t in ins]

            def run():
                h2, st = m.layer_row(i, gh, rebuild(gin))
                return (h2, *m.fixed_state(i, st)[0])
            graph, outs = self._capture(run, m.experts)
            g = self.layers[i] = (gh, gin, graph, outs)
        gh, gin, graph, outs = g
        gh.copy_(h)
        for a, b in zip(gin, ins):
            a.copy_(b)
        graph.replay()
        if not m.dense[i]:
            m.experts.count_hits(i, m.top_k)
        h2, *st = (t.clone() for t in outs)
        return h2, rebuild(st)

    # -- the whole step ----------------------------------------------------------------------------
    def step(self, items: list, last_only: bool) -> list[torch.Tensor] | None:
        """One sequence's one-row decode step by replaying its captured graph (or its chain of graphs cut at the MoE
        layers, where experts stream): the logits (on the host), with the sequence's state advanced by the row;
        None where the eager step must run."""
        m = self.model
        if not self.whole or len(items) != 1:
            return None
        ids, state, start, *rows = items[0]
        if ids.shape[0] != 1 or (rows and rows[0] is not None):
            return None
        whole = self.usable()
        if not whole and not self.cut_usable():
            return None
        key = m.graph_state(state, start)
        if key is None:
            return None
        L = -(-(start + 1) // BUCKET) * BUCKET
        cap = min(b.shape[0] for s in state for b in s.buffers())
        L = min(L, cap)
        g = self.steps.get((key, L, whole))
        if g is None:
            gid = torch.zeros(1, dtype=torch.long, device=m.device)
            gpos = torch.full((1,), start, dtype=torch.long, device=m.device)
            gid.copy_(ids)

            def run():
                return m.step_logits([(gid, list(state), start)], last_only, static=(gpos, L))[0]

            if whole:
                graph, logits = self._capture(run, m.experts)
                graphs, cuts = [graph], []
            else:
                graphs, cuts, logits = self._capture_cut(run, m.experts)
            g = self.steps[(key, L, whole)] = (gid, gpos, graphs, cuts, logits)
            while len(self.steps) > MAX_STEP_GRAPHS:
                self.steps.popitem(last=False)
        else:
            self.steps.move_to_end((key, L, whole))
        gid, gpos, graphs, cuts, logits = g
        gid.copy_(ids)
        gpos.fill_(start)
        graphs[0].replay()
        for (i, x, h, y), graph in zip(cuts, graphs[1:]):
            # the MoE layer's MLP, eagerly (through the instance's mlp_many, as the eager step calls it)
            y.copy_(m.mlp_many(i, [x], None if h is None else [h])[0])
            graph.replay()
        for i in range(len(state)):          # the rows the replay put: the states' host-side lengths follow
            state[i] = state[i].advance(1)
        if whole:
            for i, dense in enumerate(m.dense):
                if not dense:
                    m.experts.count_hits(i, m.top_k)
        return [logits.cpu()]

    # -- a step cut at its MoE layers --------------------------------------------------------------
    def cut(self, i: int, x: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
        """MoE layer i's MLP of one row x inside a cut step's warm-up (run eagerly) or capture: the graph so far
        ends here with x and h (its residual stream, for next-layer prefetch) among its outputs, the next one starts
        reading the MLP's output from a buffer the replay fills."""
        m = self.model
        if self.cutting == "warm":
            self.cutting = None
            try:
                return m.mlp_many(i, [x], None if h is None else [h])[0]
            finally:
                self.cutting = "warm"
        self._open.capture_end()
        self._segs.append(self._open)
        with torch.cuda.stream(self._outer):     # not a graph's memory: written between replays
            y = torch.empty_like(x)
        self._cuts.append((i, x, h, y))
        self._open = torch.cuda.CUDAGraph()
        self._open.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        return y

    def _capture_cut(self, run, stats_from):
        """Warm a cut step up twice (its MoE layers eager: real reads), then capture it as a chain of graphs:
        (graphs, cuts [(layer, x, h, y)], logits). The calls are no tokens: the store's counters are put back."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self._outer = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        try:
            with counters_kept(stats_from.stats), no_collection():
                side.wait_stream(self._outer)
                with torch.cuda.stream(side):
                    self.cutting = "warm"
                    for _ in range(2):
                        run()
                self._outer.wait_stream(side)
                torch.cuda.synchronize()
                self.cutting, self.capturing, self._segs, self._cuts = "capture", True, [], []
                with torch.cuda.stream(side):
                    self._open = torch.cuda.CUDAGraph()
                    self._open.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                    try:
                        logits = run()
                    finally:
                        self._open.capture_end()     # (after an error too: the stream leaves capture mode)
                    self._segs.append(self._open)
                return self._segs, self._cuts, logits
        finally:
            self._open, self._segs, self._cuts, self.cutting, self.capturing = None, [], [], None, False
