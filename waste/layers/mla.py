"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-Linear's full-attention layers), as pure functions of tensors.

Per token (architectures.md §2.2):
    q = W_q x  (or W_qb RMSNorm(W_qa x) with q-LoRA)  -> per head [q_nope ; q_pe]
    [c_kv ; k_pe] = W_kva x;  c_kv = RMSNorm(c_kv)      one latent and one k_pe shared by all heads
    q_pe, k_pe = rope(q_pe, k_pe, positions)            Kimi-Linear: no rotary at all (rope=None)
    W_kvb = kv_b_proj.weight.view(H, nope + v, R):  W_UK_h = [:, :nope],  W_UV_h = [:, nope:]
    naive:     k_h = [W_UK_h c_kv ; k_pe],  v_h = W_UV_h c_kv,  o_h = softmax(q_h . k_h * scale) v_h
    absorbed:  q~_h = W_UK_h^T q_nope_h;  score = (q~_h . c_kv + q_pe_h . k_pe) * scale;  o_h = W_UV_h sum_s p_s c_kv_s
    out = W_o [o_1 .. o_H]
The cache holds only the latent (c_kv, k_pe after rotary): kv_lora_rank + rope_dim values per token.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from waste.layers.norm import rms_norm
from waste.layers.rows import Rows
from waste.quant.linear import linear

# rope(q_pe [T, H, r], k_pe [T, r], positions [T] int64) -> (q_pe, k_pe), both in the same layout
Rope = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    eps: float  # of q_a_layernorm / kv_a_layernorm (transformers uses its RMSNorm default 1e-6 there)
    softmax_scale: float  # (nope + rope)^-0.5, times mscale^2 under YaRN
    rope: Rope | None = None
    output_gate: bool = False  # Kimi K3 (mla_use_output_gate): o *= sigmoid(g_proj x) before o_proj


class MLACache:
    """One sequence's latent cache: c_kv [T, kv_lora_rank] (normed) and k_pe [T, rope_dim] (rotated); appending
    shares the buffer (layers/rows.py)."""

    __slots__ = ("_c", "_pe")

    def __init__(self, c_kv: Tensor, k_pe: Tensor, capacity: int = 0):
        self._c, self._pe = Rows(c_kv, capacity), Rows(k_pe, capacity)

    @property
    def c_kv(self) -> Tensor:
        return self._c.data

    @property
    def k_pe(self) -> Tensor:
        return self._pe.data

    def append(self, c_kv: Tensor, k_pe: Tensor) -> "MLACache":
        """The cache with these tokens after the others (this one unchanged)."""
        out = MLACache.__new__(MLACache)
        out._c, out._pe = self._c.append(c_kv), self._pe.append(k_pe)
        return out

    @classmethod
    def empty(cls, cfg: MLAConfig, dtype: torch.dtype = torch.float32, device=None, capacity: int = 0) -> "MLACache":
        return cls(
            torch.zeros(0, cfg.kv_lora_rank, dtype=dtype, device=device),
            torch.zeros(0, cfg.qk_rope_head_dim, dtype=dtype, device=device),
            capacity,
        )

    def reset(self) -> "MLACache":
        out = MLACache.__new__(MLACache)
        out._c, out._pe = self._c.reset(), self._pe.reset()
        return out

    def __len__(self) -> int:
        return len(self._c)


def _linear(x: Tensor, w: Tensor) -> Tensor:
    return linear(x, w)   # a float tensor (cast to x's dtype) or a quantized trunk matrix


def _softmax(scores: Tensor) -> Tensor:
    return torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(scores.dtype)


def _attend_naive(q_nope, q_pe, c_kv, k_pe, w_kvb, mask, cfg: MLAConfig) -> Tensor:
    S, H, nope = c_kv.shape[0], cfg.num_heads, cfg.qk_nope_head_dim
    kv = _linear(c_kv, w_kvb).view(S, H, nope + cfg.v_head_dim)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    scores = torch.einsum("thn,shn->hts", q_nope, k_nope) + torch.einsum("thr,sr->hts", q_pe, k_pe)
    p = _softmax((scores * cfg.softmax_scale).masked_fill(mask, float("-inf")))
    return torch.einsum("hts,shv->thv", p, v)


def _attend_absorbed(q_nope, q_pe, c_kv, k_pe, w_kvb, mask, cfg: MLAConfig) -> Tensor:
    H, nope = cfg.num_heads, cfg.qk_nope_head_dim
    w = w_kvb.to(c_kv.dtype).view(H, nope + cfg.v_head_dim, cfg.kv_lora_rank)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, nope, R], [H, v, R]
    q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
    scores = torch.einsum("thr,sr->hts", q_lat, c_kv) + torch.einsum("thr,sr->hts", q_pe, k_pe)
    p = _softmax((scores * cfg.softmax_scale).masked_fill(mask, float("-inf")))
    return torch.einsum("thr,hvr->thv", torch.einsum("hts,sr->thr", p, c_kv), w_uv)


def mla_project(x: Tensor, w: dict[str, Tensor], cfg: MLAConfig, P: int, positions: Tensor | None = None):
    """The projections of T new tokens at positions P.. (or `positions`): q_nope [T, H, nope], q_pe [T, H, r]
    (rotated), the normed latent c_kv [T, R], k_pe [T, r] (rotated), and the normed q latent c_q (None without
    q-LoRA; DSA's indexer reads it)."""
    T, H = x.shape[0], cfg.num_heads
    nope, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    c_q = None
    if cfg.q_lora_rank is None:
        q = _linear(x, w["q_proj.weight"])
    else:
        c_q = rms_norm(_linear(x, w["q_a_proj.weight"]), w["q_a_layernorm.weight"], cfg.eps).to(x.dtype)
        q = _linear(c_q, w["q_b_proj.weight"])
    q = q.view(T, H, nope + r)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    kva = _linear(x, w["kv_a_proj_with_mqa.weight"])
    c_kv = rms_norm(kva[:, : cfg.kv_lora_rank], w["kv_a_layernorm.weight"], cfg.eps).to(x.dtype)
    k_pe = kva[:, cfg.kv_lora_rank :]
    if cfg.rope is not None:
        if positions is None:
            positions = torch.arange(P, P + T, device=x.device)
        q_pe, k_pe = cfg.rope(q_pe, k_pe, positions)
    return q_nope, q_pe, c_kv, k_pe, c_q


def mla_forward(
    x: Tensor,
    w: dict[str, Tensor],
    cfg: MLAConfig,
    cache: MLACache | None = None,
    positions: Tensor | None = None,
    *,
    absorb: bool | None = None,
) -> tuple[Tensor, MLACache]:
    """One MLA layer over one sequence's new tokens, attending to the cached ones and causally to each other.

    Args:
        x: [T, hidden] activations (after input_layernorm); the output has x's dtype.
        w: the layer's weights under their checkpoint names without the `model.layers.{i}.self_attn.` prefix.
        cfg: shapes, norm epsilon, softmax scale and the optional rotary hook.
        cache: the latent cache of the previous tokens, or None at the start. Not modified.
        positions: [T] absolute positions given to cfg.rope; default len(cache) + arange(T).
        absorb: use the absorbed (latent-space) form; default: only for T == 1 (decode).
    Returns:
        (out [T, hidden], the cache extended by these tokens).
    """
    T, H = x.shape[0], cfg.num_heads
    if cache is None:
        cache = MLACache.empty(cfg, x.dtype, x.device)
    P = len(cache)
    q_nope, q_pe, c_kv, k_pe, _ = mla_project(x, w, cfg, P, positions)
    cache = cache.append(c_kv, k_pe)
    # query t sits at cache position P + t and sees keys 0 .. P + t
    mask = torch.ones(T, P + T, dtype=torch.bool, device=x.device).triu(P + 1)
    attend = _attend_absorbed if (T == 1 if absorb is None else absorb) else _attend_naive
    o = attend(q_nope, q_pe, cache.c_kv, cache.k_pe, w["kv_b_proj.weight"], mask, cfg).reshape(T, H * cfg.v_head_dim)
    if cfg.output_gate:
        o = o * torch.sigmoid(_linear(x, w["g_proj.weight"]))
    return _linear(o, w["o_proj.weight"]), cache
