"""The decoder skeleton every family shares: embed, N x (attention, MLP) residual blocks, norm, head.

A family subclass says how one layer attends and what state it carries (`new_layer_state`, `attend`), and, where
its residual is not the plain `x + f(norm(x))`, how a block reads and writes the residual stream (the block hooks
`stream_in`, `block_in`, `block_out`, `stream_out`: GLM-5.3's mHC streams). Everything else, the batched `step`
included, is here, so every family is batched the same way with shared expert reads.

The routed experts are not here: the runtime's expert store makes the experts a layer routes to resident and says
in which slab slots they sit; layers/moe.py computes them from there with the kernel registered for the store's
format and device.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

from ..layers import decode_triton
from ..layers.mlp import dense_mlp
from ..layers.gpu import cuda_kernels
from ..layers.moe import kernel_for, routed_groups
from ..layers.norm import rms_norm
from ..layers.router import sigmoid_grouped_topk, softmax_topk
from ..quant.linear import linear
from ..runtime.affinity import decoding_cpu
from ..timing import NO_TIMER
from .graphs import DecodeGraphs


def _on_device(t, dtype, device: torch.device):
    """A trunk tensor on the model's device. A quantized matrix keeps its stored format on the CPU (its kernels are
    torch's CPU int8 / int4 ones); on another device it is widened to the compute dtype until that device has
    kernels of its own (layers/moe.py's registry is where they go)."""
    if device.type == "cpu":
        return t
    if not isinstance(t, torch.Tensor):
        t = t.dequantize(dtype)
    return t.to(device)


class DecoderModel:
    def __init__(self, config: dict, trunk: dict[str, torch.Tensor], experts, dtype: torch.dtype,
                 f32_names: set[str] = frozenset(), capacity: int | None = None, device: str = "cpu"):
        self.cfg, self.experts, self.dtype, self.device = config, experts, dtype, torch.device(device)
        # the context every sequence's state is allocated for, once (static state; grows only past it)
        self.capacity = capacity or config.get("max_position_embeddings") or 4096
        self.eps = config["rms_norm_eps"]
        w = {k: _on_device(v if k in f32_names else v.to(dtype), dtype, self.device) for k, v in trunk.items()}
        self.embed = w["embed_tokens.weight"]
        self.norm = w["norm.weight"]
        self.head = self.embed if config["tie_word_embeddings"] else w["lm_head.weight"]
        self.layers = []
        for i in range(config["num_layers"]):
            p = f"layers.{i}."
            self.layers.append({k[len(p):]: v for k, v in w.items() if k.startswith(p)})
        self.moe = config.get("moe") or {}
        self.top_k = self.moe.get("top_k")
        self.route_trace: list | None = None   # set to [] to record (layer, expert ids) per forward
        self.router = None                      # a stand-in for route (i, x) -> (weights, ids): waste bench --routing
        self.predict_trace: list | None = None  # set to [] to record next-layer prefetch's (layer, predicted ids)
        self.predictor = None                   # a stand-in for predict_route: a replayed trace's predictions
        self.timer = NO_TIMER                   # waste bench --profile sets a timing.Timer
        self.prefill_chunk: int | None = None   # at most this many of a sequence's rows per forward (the plan's)
        self.expert_pool = None                 # threads that share a CPU decode row's experts (Engine.load)
        self.pin_cpus = False                   # a streamed decode step's threads each on a CPU (runtime/affinity)
        self.swiglu_limit = config.get("swiglu_limit")   # clamped SwiGLU in every MLP (None: plain)
        self.dense = [self.cfg["layers"][i]["mlp"] == "dense" for i in range(len(self.layers))]
        for lw in self.layers:            # routing math is float32: convert the router once, not per token
            for k in ("mlp.gate.weight", "mlp.gate.e_score_correction_bias"):
                if k in lw:
                    lw[k] = lw[k].float()
        if self.device.type == "cuda":
            cuda_kernels()           # the triton kernels (slots read in place), where triton imports
        make_bank = getattr(experts, "make_bank", None)
        self.bank = make_bank(self.device) if make_bank is not None and self.moe else None
        self.kernel = kernel_for(self.bank.fmt, self.device) if self.bank is not None else None
        # a GPU decode step is replayed as CUDA graphs: whole once every expert is resident, else cut at the MoE
        # layers, whose MLPs run eagerly between the graphs (graphs.py)
        self.graphs = DecodeGraphs(self, DecoderModel.mlp_many) if self.device.type == "cuda" and self.bank is not None \
            else None
        self._pool: list[list] = []             # states of finished sequences, emptied (take_state)
        self._pool_lock = threading.Lock()

    # -- family hooks --------------------------------------------------------------------------------
    def new_layer_state(self, i: int):
        raise NotImplementedError

    def attend(self, i: int, x: torch.Tensor, state, positions: torch.Tensor, scratch: dict):
        """One layer's attention over one sequence's new rows; scratch: per-sequence values of this step shared by
        its layers (rotary tables, DSA's shared selection)."""
        raise NotImplementedError

    def stream_in(self, x: torch.Tensor):
        """The residual stream from the embeddings (mHC: hc_mult copies)."""
        return x

    def block_in(self, i: int, which: str, h):
        """(the sublayer's input before its norm, what block_out needs) for which = "attn" or "mlp"."""
        return h, None

    def block_out(self, i: int, which: str, h, y: torch.Tensor, ctx):
        return h + y

    def stream_out(self, h) -> torch.Tensor:
        return h

    def ffn(self, x: torch.Tensor, lw: dict, prefix: str) -> torch.Tensor:
        """A dense MLP (a dense layer's, or the shared experts') under `prefix` (K3: SiTU-GLU)."""
        return dense_mlp(x, lw, prefix, self.swiglu_limit)

    def expert_in(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The rows the routed experts read (K3's latent MoE: projected down to the latent width)."""
        return x

    def expert_out(self, i: int, y: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum, back in the residual width (K3: normed and projected up)."""
        return y

    # -- shared --------------------------------------------------------------------------------------
    def new_state(self) -> list:
        return [self.new_layer_state(i) for i in range(len(self.layers))]

    def take_state(self) -> list:
        """A sequence's state: a finished sequence's, emptied, when one is free (its buffers were allocated and
        touched once: a new request does not page-fault its way through the planned context again), else new."""
        with self._pool_lock:
            if self._pool:
                return self._pool.pop()
        return self.new_state()

    def give_state(self, state: list) -> None:
        """Hand back the state of a finished sequence for take_state to reuse."""
        fresh = [s.reset() if hasattr(s, "reset") else self.new_layer_state(i) for i, s in enumerate(state)]
        with self._pool_lock:
            self._pool.append(fresh)

    def route(self, i: int, x: torch.Tensor):
        lw, m = self.layers[i], self.moe
        if m["scoring"] == "softmax":
            return softmax_topk(x, lw["mlp.gate.weight"], self.top_k, m["norm_topk_prob"])
        return sigmoid_grouped_topk(x, lw["mlp.gate.weight"], lw.get("mlp.gate.e_score_correction_bias"), self.top_k,
                                    m["n_group"], m["topk_group"], m["norm_topk_prob"], m["routed_scaling_factor"])

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.mlp_many(i, [x])[0]

    def predict_next(self, i: int, hs: list) -> tuple[int, list[int]] | None:
        """Next-layer prefetch: the experts the next MoE layer after i will likely route to, from the residual
        stream after layer i's attention through that layer's norm and router (the family's own router, not a
        benchmark's stand-in). None where the store does not prefetch or holds the whole bank (unless predictions
        are being recorded), or where the family's blocks reshape the stream (mHC, attention residuals)."""
        if type(self).block_in is not DecoderModel.block_in:
            return None
        if self.predict_trace is None and not getattr(self.experts, "wants_prefetch", False):
            return None     # off, or the whole bank fits (nothing to gain; a decode step's ops stay as they were)
        j = next((j for j in range(i + 1, len(self.layers)) if not self.dense[j]), None)
        if j is None:
            return None
        with self.timer.section("router"):
            w = self.layers[j]["post_attention_layernorm.weight"]
            idx = [self.predict_route(j, rms_norm(h, w, self.eps))[1] for h in hs]
            if self.predict_trace is not None:
                self.predict_trace.extend((j, t.clone()) for t in idx)
            return j, torch.unique(torch.cat([t.reshape(-1) for t in idx])).tolist()

    def predict_route(self, j: int, x: torch.Tensor):
        """The router prefetch predicts with: the family's own, even where a benchmark stands in for `route`
        (`predictor` stands in for this one: a replayed trace's predictions, recorded beside its routing)."""
        return self.route(j, x) if self.predictor is None else self.predictor(j, x)

    def mlp_many(self, i: int, xs: list[torch.Tensor], hs: list | None = None) -> list[torch.Tensor]:
        """The MLP of layer i for each sequence's rows. A MoE layer asks the expert store once for the union of all
        their experts (one read serves every sequence routed to an expert); each sequence's rows are computed on
        their own (a matmul's last bits depend on its row count), so a sequence's output never depends on what it
        is batched with. hs: the residual streams these rows were normed from, for next-layer prefetch."""
        lw, timer = self.layers[i], self.timer
        if self.dense[i]:
            with timer.section("trunk matvec"):
                return [self.ffn(x, lw, "mlp.") for x in xs]
        if self.graphs is not None and len(xs) == 1:
            if self.graphs.cutting:          # a step cut here into graphs: this MLP runs between them (graphs.py)
                return [self.graphs.cut(i, xs[0], hs[0] if hs else None)]
            y = self.graphs.mlp(i, xs[0])
            if y is not None:
                return [y]
        with timer.section("router"):
            route = self.route if self.router is None else self.router
            routed = [route(i, x) for x in xs]
        if self.route_trace is not None:
            self.route_trace.extend((i, idx.clone()) for _, idx in routed)
        with timer.section("expert compute"):
            ins = [self.expert_in(i, x) for x in xs]
            if hasattr(self.experts, "exchange"):     # expert parallel (runtime/parallel.py): the owners compute
                ys = self.experts.exchange(i, ins, routed)
            else:   # computed group by group as the records land (the store reads the rest meanwhile)
                ahead = None if hs is None else self.predict_next(i, hs)
                groups = self.experts.resident(i, [idx for _, idx in routed], **({"ahead": ahead} if ahead else {}))
                ws = [w for w, _ in routed]
                rows = None if self.graphs is None else self.graphs.row_groups(ins, self.bank, self.kernel)
                ys = [rows.run(i, ins[0], ws[0], groups, self.bank, self.kernel)] if rows is not None else \
                    routed_groups(ins, ws, groups, self.bank, self.kernel, self.expert_pool)
            ys = [self.expert_out(i, y) for y in ys]
        if self.moe.get("num_shared_experts"):
            with timer.section("trunk matvec"):
                ys = [y + self.ffn(x, lw, "mlp.shared_experts.") for x, y in zip(xs, ys)]
        return ys

    def fixed_state(self, i: int, st):
        """Family hook: (layer i's state as fixed-shape tensors, the function rebuilding a state from such tensors)
        where a one-row step of the whole layer can be captured as a CUDA graph (graphs.py `layer`), else None."""
        return None

    def layer_row(self, i: int, h, st):
        """Layer i over one sequence's rows h whose attention needs no position (fixed_state's layers): (h', the
        layer's new state). What the step's layer loop does for one sequence; graphs.py captures it."""
        lw = self.layers[i]
        u, ctx = self.block_in(i, "attn", h)
        a, st = self.attend(i, rms_norm(u, lw["input_layernorm.weight"], self.eps), st, None, {})
        h = self.block_out(i, "attn", h, a, ctx)
        u, ctx = self.block_in(i, "mlp", h)
        y = self.mlp_many(i, [rms_norm(u, lw["post_attention_layernorm.weight"], self.eps)], [h])[0]
        return self.block_out(i, "mlp", h, y, ctx), st

    def graph_state(self, state, start: int):
        """Family hook: the key of a captured whole decode step for this sequence's state (its buffers), or None
        where the family's attention has no fixed-shape form (then only the MoE layers are graphed)."""
        return None

    @torch.inference_mode()
    def step(self, items: list, last_only: bool = True) -> list[torch.Tensor]:
        """items [(ids [T], state, start[, rows])], one per sequence, each continuing its sequence of `start` tokens
        (rows: an EmbeddedRows whose rows replace the embeddings at its positions: images) ->
        float32 logits per sequence ([1, V] with last_only, else [T, V]). The one forward of prefill and decode, of
        one request (Engine.generate) and of a batch (the server's scheduler); a sequence's logits are bit-identical
        alone or batched."""
        if self.graphs is not None:            # one sequence's decode step replayed as one CUDA graph (graphs.py)
            out = self.graphs.step(items, last_only)
            if out is not None:
                return out
        if self.expert_pool is not None and all(it[0].shape[0] == 1 for it in items) and torch.get_num_threads() > 1:
            # decode rows streamed on the CPU: torch's ops on one thread, the other cores the expert pool's (OpenMP's
            # workers spin between regions and took them: attention 15x slower, LEARNED §3j); a row computes to the
            # same bits at any thread count (§3b)
            from ..numba_ptr import row_helper

            n = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                # its thread also takes the q8 rows' chunks (§3n); this thread on a CPU apart from the pool's (§3p)
                with row_helper(self.expert_pool), decoding_cpu(n) if self.pin_cpus else contextlib.nullcontext():
                    return self.step(items, last_only)
            finally:
                torch.set_num_threads(n)
        c = self.prefill_chunk
        # a prompt carrying image rows runs whole: its rows are spliced over its placeholders in one piece
        if c and any(it[0].shape[0] > c for it in items) and not any(len(it) > 3 and it[3] is not None for it in items):
            return self._chunked(items, last_only, c)
        return [t if t.device.type == "cpu" else t.cpu() for t in self.step_logits(items, last_only)]  # sampling: host

    def step_logits(self, items: list, last_only: bool = True, static=None) -> list[torch.Tensor]:
        """step's logits on the model's device. static: (position tensor [1], L) for a captured decode step
        (graphs.py): the family's attention reads the position from the tensor and attends over L cache rows."""
        hs, positions, scratch = [], [], []
        for ids, _, start, *rows in items:
            if ids.device != self.device:
                ids = ids.to(self.device)
            x = F.embedding(ids, self.embed)
            if rows and rows[0] is not None:     # an image's rows in place of its placeholders' embeddings
                x = rows[0].splice(x, start)
            hs.append(self.stream_in(x))
            positions.append(torch.arange(start, start + ids.shape[0], device=self.device))
            scratch.append({"start": start} if static is None else {"start": start, "static": static})
        # a plain residual on a GPU: each add and the norm after it in one launch (decode_triton.add_rms); pend holds
        # the next norm's rows, taken by the next layer (or the head) in place of its own norm of the same bits
        fuse = self._plain_residual() and decode_triton.norm_usable(hs[0], self.norm)
        pend: list = [None] * len(items)
        for i, lw in enumerate(self.layers):
            if self.graphs is not None and len(items) == 1 and static is None:    # a layer replayed (graphs.py)
                got = self.graphs.layer(i, hs[0], items[0][1][i])
                if got is not None:
                    hs[0], items[0][1][i] = got
                    pend[0] = None
                    continue
            normed, ctxs = [], []
            for j, (_, state, *_) in enumerate(items):
                u, ctx = self.block_in(i, "attn", hs[j])
                x = pend[j] if pend[j] is not None else rms_norm(u, lw["input_layernorm.weight"], self.eps)
                with self.timer.section("attention"):
                    a, state[i] = self.attend(i, x, state[i], positions[j], scratch[j])
                if fuse:
                    hs[j], x = decode_triton.add_rms(hs[j], a, lw["post_attention_layernorm.weight"], self.eps)
                else:
                    hs[j] = self.block_out(i, "attn", hs[j], a, ctx)
                    u, ctx = self.block_in(i, "mlp", hs[j])
                    x = rms_norm(u, lw["post_attention_layernorm.weight"], self.eps)
                normed.append(x)
                ctxs.append(ctx)
            nxt = self.layers[i + 1]["input_layernorm.weight"] if i + 1 < len(self.layers) else self.norm
            for j, y in enumerate(self.mlp_many(i, normed, hs)):
                if fuse:
                    hs[j], pend[j] = decode_triton.add_rms(hs[j], y, nxt, self.eps)
                else:
                    hs[j] = self.block_out(i, "mlp", hs[j], y, ctxs[j])
        out = []
        for h, p in zip(hs, pend):
            x = self.stream_out(h) if p is None else p
            if last_only:
                x = x[-1:]
            with self.timer.section("trunk matvec"):
                out.append(linear(rms_norm(x, self.norm, self.eps) if p is None else x, self.head).float())
        return out

    def _plain_residual(self) -> bool:
        """Whether the family's blocks are the plain `h + f(norm(h))` (no block hooks of its own)."""
        t = type(self)
        return all(getattr(t, f) is getattr(DecoderModel, f) for f in ("stream_in", "block_in", "block_out",
                                                                       "stream_out"))

    def _chunked(self, items: list, last_only: bool, c: int) -> list[torch.Tensor]:
        """step over chunks of at most c rows per sequence (chunked prefill: a chunk's activations are what the plan
        counts; one residency call per layer and chunk, so a chunk's tokens share its expert reads)."""
        outs: list[list[torch.Tensor]] = [[] for _ in items]
        for off in range(0, max(it[0].shape[0] for it in items), c):
            live = [j for j, it in enumerate(items) if off < it[0].shape[0]]
            got = self.step([(items[j][0][off:off + c], items[j][1], items[j][2] + off) for j in live], last_only)
            for j, y in zip(live, got):
                outs[j] = [y] if last_only else outs[j] + [y]
        return [o[0] if last_only else torch.cat(o) for o in outs]

    def forward(self, ids: torch.Tensor, state: list, start: int, last_only: bool = False) -> torch.Tensor:
        """ids [T] continuing a sequence of `start` tokens; returns float32 logits [T, V] (or [1, V])."""
        return self.step([(ids, state, start)], last_only)[0]

