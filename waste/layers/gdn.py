"""Gated DeltaNet, the linear-attention layer of Qwen3-Next, as pure functions of tensors.

Per token, with Hk query/key heads of width dk and Hv value heads of width dv (Hv a multiple of Hk: each q/k head
serves Hv / Hk consecutive value heads):
    [q; k; v] = SiLU(causal depthwise conv_K(q, k, v projections))   one short conv over the three together
    q, k      = l2-normalised, q *= dk^-0.5
    g_t       = -exp(A_log) * softplus(a_t + dt_bias)     one log-decay per value head (KDA's is per channel)
    beta_t    = sigmoid(b_t)
    S_t       = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T,   o_t = S_t^T q_t
    out       = out_proj(RMSNorm(o_t) * w * SiLU(z_t))
q, k, v, z come from one projection laid out per key head ([q, k, v (Hv/Hk heads), z (Hv/Hk heads)] each), b and a
from another ([b (Hv/Hk), a (Hv/Hk)] per key head). The recurrence is KDA's (layers/kda.py) with the head's decay
on every key channel, so its chunked form is reused as it is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..quant.linear import linear
from .kda import _l2norm, _state_dtype, kda_chunked, kda_recurrent, short_conv
from .norm import rms_norm


@dataclass(frozen=True)
class GDNConfig:
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    eps: float            # the output norm's epsilon (rms_norm_eps)


@dataclass
class GDNState:
    """One sequence's state: the last K-1 conv inputs [K-1, C] (C = 2 Hk dk + Hv dv) and S [Hv, dk, dv]."""

    conv: Tensor
    S: Tensor

    @classmethod
    def empty(cls, cfg: GDNConfig, dtype=torch.float32, device=None) -> "GDNState":
        C = 2 * cfg.num_k_heads * cfg.k_dim + cfg.num_v_heads * cfg.v_dim
        return cls(torch.zeros(cfg.conv_kernel - 1, C, dtype=dtype, device=device),
                   torch.zeros(cfg.num_v_heads, cfg.k_dim, cfg.v_dim, dtype=_state_dtype(dtype), device=device))


def gdn_forward(x: Tensor, w: dict[str, Tensor], cfg: GDNConfig, state: GDNState | None = None
                ) -> tuple[Tensor, GDNState]:
    """One Gated DeltaNet layer over one sequence's new rows x [T, hidden]; w: the layer's weights without the
    `linear_attn.` prefix. Returns (out [T, hidden], the state after these rows); `state` is not modified."""
    T = x.shape[0]
    Hk, Hv, dk, dv = cfg.num_k_heads, cfg.num_v_heads, cfg.k_dim, cfg.v_dim
    r = Hv // Hk
    if state is None:
        state = GDNState.empty(cfg, x.dtype, x.device)
    cd = _state_dtype(x.dtype)
    qkvz = linear(x, w["in_proj_qkvz.weight"]).view(T, Hk, 2 * dk + 2 * r * dv)
    q, k, v, z = qkvz.split((dk, dk, r * dv, r * dv), dim=-1)
    ba = linear(x, w["in_proj_ba.weight"]).view(T, Hk, 2 * r)
    b, a = ba[..., :r].reshape(T, Hv), ba[..., r:].reshape(T, Hv)
    mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
    mixed, conv = short_conv(mixed, w["conv1d.weight"], state.conv)
    q, k, v = mixed.split((Hk * dk, Hk * dk, Hv * dv), dim=-1)
    q = _l2norm(q.to(cd).reshape(T, Hk, dk)).repeat_interleave(r, dim=1) * dk ** -0.5
    k = _l2norm(k.to(cd).reshape(T, Hk, dk)).repeat_interleave(r, dim=1)
    v = v.to(cd).reshape(T, Hv, dv)
    g = -torch.exp(w["A_log"].to(cd)) * F.softplus(a.to(cd) + w["dt_bias"].to(cd))      # [T, Hv]
    beta = torch.sigmoid(b.to(cd))
    recur = kda_recurrent if T == 1 else kda_chunked
    o, S = recur(q, k, v, g[..., None].expand(T, Hv, dk), beta, state.S.to(cd))
    o = rms_norm(o.to(x.dtype), w["norm.weight"], cfg.eps) * F.silu(z.reshape(T, Hv, dv).to(cd)).to(x.dtype)
    return linear(o.reshape(T, Hv * dv), w["out_proj.weight"]), GDNState(conv, S)
