"""DeepSeek Sparse Attention over k-pools (GLM-5.3-Flash), as pure functions of tensors (architectures.md §3-4).

A DSA layer is an MLA layer (q-LoRA; GLM-5.3 has no rotary) whose queries attend only to the tokens a small
"lightning indexer" selects. GLM-5.3 scores pools of `kpool` consecutive tokens rather than single tokens:
    k_s   = LayerNorm(W_k x_s)  (weight and bias, eps 1e-6)          one index key per token  [D]
    g_s   = W_cg x_s                                                 its compress-gate logits [D]
    pool p = tokens p*kpool .. p*kpool + kpool-1 (from the sequence start); once complete its key is
            K_p = sum_i softmax_i(g_i + ape_i) * k_i                 (softmax over the pool's tokens, per channel)
    q_t   = W_qb^I c_Q_t  [n_I, D]   (c_Q = q_a_layernorm(q_a_proj x), shared with MLA)
    w_t   = W_w x_t * n_I^-1/2
    I_t,p = sum_h w_t,h ReLU(q_t,h . K_p * D^-1/2)                   for the complete pools visible to t
Query t sees n_c = (t+1) // kpool complete pools and a tail of (t+1) % kpool tokens. It attends to the best
topk // kpool pools (expanded back to their tokens) plus the whole tail. While n_c <= topk // kpool (a context not
longer than index_topk, and up to kpool-1 tokens more) that is every visible token: exactly the dense causal path,
and the indexer's scores are not even needed. Ties are broken towards the lower pool index (a stable sort), so a
selection does not depend on how many tokens were computed together.

The indexer's cache is compact: one compressed key per complete pool, plus the raw keys and gate logits of the
incomplete tail (fewer than kpool tokens); it is extended with the MLA latent cache, token for token.

DeepSeek-V3.2 (`pooled=False`, kpool 1) scores single tokens: no compress gate, every token's key is a "pool", and
the first `rope_dim` channels of the index query and key are rotated (`rope`, half-split, at the token's position)
before scoring. Its selection is the same `select` with kpool 1: dense while t + 1 <= index_topk, else the
index_topk best visible tokens (no tail).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .rows import Rows
from .mla import MLACache, MLAConfig, _attend_absorbed, _attend_naive, _linear, mla_project


@dataclass(frozen=True)
class DSAConfig:
    n_heads: int         # index_n_heads
    head_dim: int        # index_head_dim
    topk: int            # index_topk, in tokens (a multiple of kpool)
    kpool: int           # index_kpool
    k_norm_eps: float = 1e-6
    pooled: bool = True  # False: DeepSeek-V3.2, per-token keys, no compress gate (kpool must be 1)
    rope: Callable | None = None  # (q [T, n_I, r], k [T, r], positions) -> both rotated: V3.2's indexer rotary
    rope_dim: int = 0    # r, the leading channels of the index query and key that `rope` rotates

    @property
    def budget(self) -> int:
        """How many pools a query may select."""
        return self.topk // self.kpool


@dataclass
class IndexerCache:
    """Compressed keys of the complete pools [N, D] (rows appended into a buffer sized for the planned context,
    layers/rows.py), and the keys / gate logits of the incomplete tail [r, D]."""

    pool_rows: Rows
    tail_k: Tensor
    tail_g: Tensor

    @property
    def pools(self) -> Tensor:
        return self.pool_rows.data

    @classmethod
    def empty(cls, cfg: DSAConfig, dtype: torch.dtype = torch.float32, device=None, capacity: int = 0) -> "IndexerCache":
        z = torch.zeros(0, cfg.head_dim, dtype=dtype, device=device)
        return cls(Rows(z, capacity // cfg.kpool + 1 if capacity else 0), z.clone(), z.clone())

    def reset(self) -> "IndexerCache":
        z = self.tail_k[:0]
        return IndexerCache(self.pool_rows.reset(), z, z)


@dataclass
class DSACache:
    """One DSA layer's state: the MLA latent cache and (for a layer with its own indexer) the indexer cache."""

    mla: MLACache
    index: IndexerCache | None

    @classmethod
    def empty(cls, mla_cfg: MLAConfig, cfg: DSAConfig, own_indexer: bool, dtype=torch.float32, device=None,
              capacity: int = 0):
        return cls(MLACache.empty(mla_cfg, dtype, device, capacity),
                   IndexerCache.empty(cfg, dtype, device, capacity) if own_indexer else None)

    def reset(self) -> "DSACache":
        return DSACache(self.mla.reset(), self.index.reset() if self.index is not None else None)

    def __len__(self) -> int:
        return len(self.mla)


def _rotate(q: Tensor, k: Tensor, cfg: DSAConfig, positions: Tensor) -> tuple[Tensor, Tensor]:
    """V3.2: the leading rope_dim channels of the index queries [T, n_I, D] and keys [T, D] rotated."""
    r = cfg.rope_dim
    q_r, k_r = cfg.rope(q[..., :r], k[:, :r], positions)
    return torch.cat([q_r, q[..., r:]], dim=-1), torch.cat([k_r, k[:, r:]], dim=-1)


def indexer_keys(x: Tensor, w: dict[str, Tensor], cfg: DSAConfig,
                 positions: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Per-token index keys k [T, D] (LayerNorm with bias; rotated when cfg.rope) and compress-gate logits
    g [T, D] (None unless pooled), in x's dtype."""
    k = _linear(x, w["indexer.wk.weight"])
    cd = torch.promote_types(x.dtype, torch.float32)
    k = F.layer_norm(k.to(cd), (cfg.head_dim,), w["indexer.k_norm.weight"].to(cd), w["indexer.k_norm.bias"].to(cd),
                     cfg.k_norm_eps).to(x.dtype)
    if cfg.rope is not None:
        k = _rotate(k[:, None], k, cfg, positions)[1]
    g = _linear(x, w["indexer.index_kpool_compress_gate"]) if cfg.pooled else None
    return k, g


def compress_pools(k: Tensor, g: Tensor, ape: Tensor, kpool: int) -> Tensor:
    """Complete pools' keys: k, g [N * kpool, D] -> [N, D] (softmax over each pool's tokens, per channel)."""
    N = k.shape[0] // kpool
    kk, gg = k.view(N, kpool, -1), g.view(N, kpool, -1)
    cd = torch.promote_types(k.dtype, torch.float32)
    p = torch.softmax(gg.to(cd) + ape.to(cd)[None], dim=1).to(k.dtype)
    return (p * kk).sum(dim=1)


def extend_index(cache: IndexerCache, k: Tensor, g: Tensor | None, ape: Tensor | None, kpool: int) -> IndexerCache:
    """The indexer cache after appending T tokens' keys and gate logits (not modified in place); g None: per-token
    keys (V3.2), appended as they are."""
    if g is None:
        return IndexerCache(cache.pool_rows.append(k), cache.tail_k, cache.tail_g)
    kk = torch.cat([cache.tail_k.to(k.dtype), k])
    gg = torch.cat([cache.tail_g.to(g.dtype), g])
    n = (kk.shape[0] // kpool) * kpool
    pools = cache.pool_rows
    if n:
        pools = pools.append(compress_pools(kk[:n], gg[:n], ape, kpool))
    return IndexerCache(pools, kk[n:].clone(), gg[n:].clone())


def index_scores(x: Tensor, c_q: Tensor, pools: Tensor, w: dict[str, Tensor], cfg: DSAConfig,
                 positions: Tensor | None = None) -> Tensor:
    """I [T, N] float32: sum_h w_t,h ReLU(q_t,h . K_p / sqrt(D)) for every query and every complete pool."""
    T = x.shape[0]
    q = _linear(c_q, w["indexer.wq_b.weight"]).view(T, cfg.n_heads, cfg.head_dim)
    if cfg.rope is not None:
        q = _rotate(q, q[:, 0], cfg, positions)[0]
    cd = torch.promote_types(x.dtype, torch.float32)
    wts = _linear(x, w["indexer.weights_proj.weight"]).to(cd) * cfg.n_heads ** -0.5
    # heads in blocks, so the [T, heads, N] intermediate stays near 2^26 values (V3.2: 64 heads, N = every token)
    hb = max(1, min(cfg.n_heads, (1 << 26) // max(1, T * pools.shape[0])))
    out = None
    for h in range(0, cfg.n_heads, hb):
        s = F.relu(torch.einsum("thd,pd->thp", q[:, h:h + hb].to(cd), pools.to(cd)) * cfg.head_dim ** -0.5)
        part = torch.einsum("th,thp->tp", wts[:, h:h + hb], s)
        out = part if out is None else out + part
    return out


@dataclass
class Selection:
    """Which keys each query attends to. keep [T, S] bool (None: every visible key, the dense path), and per
    query (for the trace): the number of visible complete pools, the chosen pools and their scores."""

    keep: Tensor | None
    visible_pools: list[int]
    pools: list[list[int] | None]           # None: dense for this query (all visible pools)
    scores: Tensor | None                   # [T, N] index scores when they were computed


def select(scores: Tensor | None, P: int, T: int, cfg: DSAConfig, device=None) -> Selection:
    """The keys queries P .. P+T-1 attend to, from their pool scores [T, N] (N >= visible pools of the last one)."""
    pos = torch.arange(P, P + T, device=device)
    n_vis = (pos + 1) // cfg.kpool
    dense = n_vis <= cfg.budget
    vis = n_vis.tolist()
    if bool(dense.all()):
        return Selection(None, vis, [None] * T, scores)
    S = P + T
    N = scores.shape[1]
    tok = torch.arange(S, device=device)
    pidx = torch.arange(N, device=device)
    masked = scores.masked_fill(pidx[None, :] >= n_vis[:, None], float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, : cfg.budget]   # [T, K]
    chosen = torch.zeros(T, N + 1, dtype=torch.bool, device=device)      # column N: tokens past the last pool
    chosen.scatter_(1, order, True)
    pool_of = (tok // cfg.kpool).clamp(max=N)
    visible = tok[None, :] <= pos[:, None]
    tail = tok[None, :] >= (n_vis * cfg.kpool)[:, None]
    keep_sparse = (chosen[:, pool_of] | tail) & visible
    keep = torch.where(dense[:, None], visible, keep_sparse)
    pools = [None if d else sorted(o.tolist()) for d, o in zip(dense.tolist(), order)]
    return Selection(keep, vis, pools, scores)


def keep_from_indices(indices: Tensor, S: int) -> Tensor:
    """A [T, S] keep mask from per-query token indices [T, W] (-1 = unused slot), transformers' indexer output."""
    T = indices.shape[0]
    valid = (indices >= 0) & (indices < S)
    keep = torch.zeros(T, S + 1, dtype=torch.bool, device=indices.device)
    keep.scatter_(1, torch.where(valid, indices.long(), S), True)
    return keep[:, :S]


def dsa_forward(
    x: Tensor,
    w: dict[str, Tensor],
    mla_cfg: MLAConfig,
    cfg: DSAConfig,
    cache: DSACache,
    positions: Tensor | None = None,
    *,
    shared: Selection | None = None,
    keep: Tensor | None = None,
    want_scores: bool = False,
    absorb: bool | None = None,
) -> tuple[Tensor, DSACache, Selection]:
    """One DSA layer over one sequence's new tokens.

    Args:
        x: [T, hidden] (after input_layernorm). w: the layer's `self_attn.` weights (with `indexer.*` when the
        layer has its own indexer). cache: this layer's DSACache (not modified).
        shared: for a layer without an indexer (`indexer_types` "shared"), the previous full layer's selection.
        keep: a [T, len(cache) + T] mask that replaces the selection (tests: "attention given the oracle's keys").
        want_scores: compute the index scores even where every query takes the dense path (the trace).
        absorb: the absorbed (latent-space) attention; default only for T == 1.
    Returns:
        (out [T, hidden], the extended cache, the selection used).
    """
    T, H = x.shape[0], mla_cfg.num_heads
    P = len(cache)
    q_nope, q_pe, c_kv, k_pe, c_q = mla_project(x, w, mla_cfg, P, positions)
    mla = cache.mla.append(c_kv, k_pe)
    if positions is None and cfg.rope is not None:
        positions = torch.arange(P, P + T, device=x.device)

    index = cache.index
    if index is not None:
        k_i, g_i = indexer_keys(x, w, cfg, positions)
        index = extend_index(index, k_i, g_i, w.get("indexer.index_kpool_compress_ape"), cfg.kpool)
    if keep is not None:
        sel = Selection(keep, [], [], None)
    elif index is None:
        if shared is None:
            raise ValueError("a shared DSA layer needs the selection of a previous layer with its own indexer")
        sel = shared
    else:
        n_vis_last = (P + T) // cfg.kpool
        need = want_scores or n_vis_last > cfg.budget
        scores = index_scores(x, c_q, index.pools, w, cfg, positions) if need else None
        sel = select(scores, P, T, cfg, x.device)

    S = P + T
    if T == 1 and (absorb is None or absorb):
        if sel.keep is None:
            o = _attend_absorbed(q_nope, q_pe, mla.c_kv, mla.k_pe, w["kv_b_proj.weight"],
                                 torch.zeros(1, S, dtype=torch.bool, device=x.device), mla_cfg)
        else:
            idx = sel.keep[0].nonzero().squeeze(1)
            o = _attend_absorbed(q_nope, q_pe, mla.c_kv[idx], mla.k_pe[idx], w["kv_b_proj.weight"],
                                 torch.zeros(1, idx.shape[0], dtype=torch.bool, device=x.device), mla_cfg)
    else:
        mask = torch.ones(T, S, dtype=torch.bool, device=x.device).triu(P + 1)
        if sel.keep is not None:
            mask = mask | ~sel.keep
        attend = _attend_absorbed if absorb else _attend_naive
        o = attend(q_nope, q_pe, mla.c_kv, mla.k_pe, w["kv_b_proj.weight"], mask, mla_cfg)
    out = _linear(o.reshape(T, H * mla_cfg.v_head_dim), w["o_proj.weight"])
    return out, DSACache(mla, index), sel


def trace_lines(layer: int, P: int, sel: Selection, kpool: int) -> list[str]:
    """WASTE_DUMP_DSA: per query, which pools won and on what scores (and the best loser, to tell a tie)."""
    out = []
    for i, (n_vis, pools) in enumerate(zip(sel.visible_pools, sel.pools)):
        t = P + i
        tail = f"tail {n_vis * kpool}..{t}" if (t + 1) % kpool else "no tail"
        s = sel.scores[i] if sel.scores is not None else None
        if pools is None:
            won = f"dense: all {n_vis} pools"
            if s is not None and n_vis:
                won += " [" + " ".join(f"{p}:{s[p].item():.6g}" for p in range(n_vis)) + "]"
            out.append(f"dsa layer {layer} pos {t}: {won}, {tail}")
            continue
        chosen = set(pools)
        ranked = sorted(pools, key=lambda p: (-s[p].item(), p))
        losers = [p for p in range(n_vis) if p not in chosen]
        best_loser = max(losers, key=lambda p: (s[p].item(), -p)) if losers else None
        won = " ".join(f"{p}:{s[p].item():.6g}" for p in ranked)
        lost = f"; best loser {best_loser}:{s[best_loser].item():.6g}" if best_loser is not None else ""
        out.append(f"dsa layer {layer} pos {t}: {len(pools)} of {n_vis} pools [{won}]{lost}, {tail}")
    return out
