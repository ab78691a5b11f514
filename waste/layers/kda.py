"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi-Linear, as pure functions of tensors.

Per head (h heads of width d), per token t (architectures.md §1.2):
    q, k, v = SiLU(causal depthwise conv_K(W_q x)), ... (one short conv each, state = last K-1 inputs)
    q, k    = q / sqrt(|q|^2 + 1e-6), k / sqrt(|k|^2 + 1e-6);  q *= d^-0.5
    g_t     = -exp(A_log) * softplus(W_fb W_fa x + dt_bias)       per-channel log-decay, [h, d]
    beta_t  = sigmoid(W_b x)                                      [h]
    S_t     = Diag(exp g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T      S: [d_k, d_v]
    o_t     = S_t^T q_t
    out     = W_o [gated_rms_norm(o_t, W_gb W_ga x)]

`kda_forward` runs the chunked (WY / UT) form for T > 1 and the plain recurrence for T == 1; both are exact
rewrites of the same recurrence. The recurrence runs in float32 (float64 when x is float64).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..quant.linear import linear

CHUNK = 64
QK_NORM_EPS = 1e-6


@dataclass(frozen=True)
class KDAConfig:
    num_heads: int
    head_dim: int
    conv_kernel: int
    eps: float  # o_norm (gated RMSNorm) epsilon: the model's rms_norm_eps
    lower_bound: float | None = None  # GLM-5.3's safe gate: g = lower_bound * sigmoid(exp(A_log) * f); None: Kimi's gate
    full_rank_gate: bool = False  # Kimi K3: the output gate is one g_proj [H*d, hidden], not g_b(g_a(x))


@dataclass
class KDAState:
    """One sequence's KDA state: the last K-1 conv inputs of q, k, v ([K-1, C], C = H*d) and S [H, d_k, d_v]."""

    conv_q: Tensor
    conv_k: Tensor
    conv_v: Tensor
    S: Tensor

    def tensors(self) -> tuple[Tensor, ...]:
        return self.conv_q, self.conv_k, self.conv_v, self.S

    @classmethod
    def of(cls, tensors) -> "KDAState":
        return cls(*tensors)

    @classmethod
    def empty(cls, cfg: KDAConfig, dtype: torch.dtype = torch.float32, device=None) -> "KDAState":
        C = cfg.num_heads * cfg.head_dim
        conv = [torch.zeros(cfg.conv_kernel - 1, C, dtype=dtype, device=device) for _ in range(3)]
        S = torch.zeros(cfg.num_heads, cfg.head_dim, cfg.head_dim, dtype=_state_dtype(dtype), device=device)
        return cls(*conv, S)


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, times weight, times sigmoid(gate) (sigmoid, not SiLU as in Qwen3-Next).

    All in float32 (float64 stays float64); cast to x's dtype once at the end, as fla and transformers do.
    """
    cd = _state_dtype(x.dtype)
    h = x.to(cd)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(cd) * h * torch.sigmoid(gate.to(cd))).to(x.dtype)


def _linear(x: Tensor, w: Tensor) -> Tensor:
    return linear(x, w)   # a float tensor (cast to x's dtype) or a quantized trunk matrix


def short_conv(x: Tensor, weight: Tensor, conv_state: Tensor) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv1d + SiLU over time, continuing from conv_state.

    x [T, C], weight [C, 1, K], conv_state [K-1, C] (the previous K-1 inputs, zeros at the start).
    Returns (SiLU(conv(x)) [T, C], new conv_state [K-1, C]).
    """
    T, C = x.shape
    K = weight.shape[-1]
    xs = torch.cat([conv_state.to(x.dtype), x], dim=0)  # [K-1+T, C]
    w = weight.reshape(C, 1, K).to(x.dtype)
    y = F.conv1d(xs.t().unsqueeze(0), w, groups=C)[0].t()  # [T, C]
    return F.silu(y), xs[xs.shape[0] - (K - 1) :].clone()


def kda_gate(x: Tensor, w: dict[str, Tensor], cfg: KDAConfig, dtype: torch.dtype) -> Tensor:
    """Per-channel log-decay g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias), [T, H, d] in dtype (<= 0).

    With cfg.lower_bound (GLM-5.3-Flash): g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias)),
    which keeps every step's decay inside (lower_bound, 0)."""
    H, d = cfg.num_heads, cfg.head_dim
    f = _linear(_linear(x, w["f_a_proj.weight"]), w["f_b_proj.weight"]).to(dtype)
    f = f + w["dt_bias"].to(dtype).reshape(H * d)
    A = torch.exp(w["A_log"].to(dtype).reshape(H))  # stored [1,1,H,1] (Kimi) or [H] (GLM, K3)
    if cfg.lower_bound is not None:
        return cfg.lower_bound * torch.sigmoid(A[:, None] * f.view(-1, H, d))
    return -A[:, None] * F.softplus(f.view(-1, H, d))


def _l2norm(x: Tensor) -> Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + QK_NORM_EPS)


def kda_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """The KDA recurrence, token by token.

    q, k [T, H, dk] (already L2-normalised, q already scaled), v [T, H, dv], g [T, H, dk] (log-decay),
    beta [T, H], S [H, dk, dv]. All in one dtype. Returns (o [T, H, dv], S_T).
    """
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[..., None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
        S = S + k[t][..., None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(out), S


def _decayed_scores(qs: list[Tensor], k: Tensor, G: Tensor, sub: int) -> list[Tensor]:
    """For each q in qs: P[h, t, i] = sum_c q[h,t,c] k[h,i,c] exp(G[h,t,c] - G[h,i,c]) for i <= t, else 0.

    q, k, G [H, L, dk] with G non-increasing along L. Rows are taken in blocks of `sub`: columns left of a block
    factor through the block's first row m, exp(G_t - G_m) * exp(G_m - G_i) with both exponents <= 0 (one matmul,
    no overflow); the block's own triangle takes the exact [sub, sub, dk] difference form.
    """
    H, L, _ = k.shape
    out = [k.new_zeros(H, L, L) for _ in qs]
    for s0 in range(0, L, sub):
        s1 = min(s0 + sub, L)
        Gb = G[:, s0:s1]
        Gm = Gb[:, :1]
        k_left = (k[:, :s0] * (Gm - G[:, :s0]).exp()).transpose(1, 2) if s0 else None
        n = s1 - s0
        causal = torch.ones(n, n, dtype=torch.bool, device=k.device).tril()
        diff = (Gb[:, :, None, :] - Gb[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
        kd = diff.exp() * k[:, None, s0:s1, :]  # [H, n(t), n(i), dk]
        for q, P in zip(qs, out):
            if s0:
                P[:, s0:s1, :s0] = (q[:, s0:s1] * (Gb - Gm).exp()) @ k_left
            P[:, s0:s1, s0:s1] = (q[:, s0:s1, None, :] * kd).sum(-1)
    return out


def kda_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor, chunk: int = CHUNK, sub: int = 8
) -> tuple[Tensor, Tensor]:
    """The same recurrence as kda_recurrent, computed chunk by chunk (same arguments and results).

    Within a chunk with cumulative log-decay G_t = sum_{s<=t} g_s, the update written as
    S_t = Diag(e^{g_t}) S_{t-1} + k_t u_t^T has pseudo-values U solving the unit lower-triangular system
        (I + A) U = diag(beta) (V - (K * e^G) S0),   A_ti = beta_t sum_c k_tc k_ic e^{G_tc - G_ic}  (i < t),
    then  O = (Q * e^G) S0 + M U  with  M_ti = sum_c q_tc k_ic e^{G_tc - G_ic}  (i <= t),
    and   S_L = e^{G_L} * S0 + (K * e^{G_L - G})^T U.
    Every exponent is a difference G_t - G_i <= 0 (see _decayed_scores), so nothing overflows.
    """
    T = k.shape[0]
    out = []
    for s in range(0, T, chunk):
        qc, kc, vc, bc = (a[s : s + chunk].transpose(0, 1) for a in (q, k, v, beta))  # [H, L, *], bc [H, L]
        G = g[s : s + chunk].transpose(0, 1).cumsum(1)  # [H, L, dk]
        L = G.shape[1]
        M, KK = _decayed_scores([qc, kc], kc, G, sub)
        I_A = (KK * bc[:, :, None]).tril(-1) + torch.eye(L, dtype=KK.dtype, device=KK.device)
        eG = G.exp()
        rhs = bc[:, :, None] * torch.cat([vc, kc * eG], dim=-1)  # [H, L, dv + dk]
        sol = torch.linalg.solve_triangular(I_A, rhs, upper=False, unitriangular=True)
        U = sol[..., : vc.shape[-1]] - sol[..., vc.shape[-1] :] @ S  # [H, L, dv]
        out.append(((qc * eG) @ S + M @ U).transpose(0, 1))
        GL = G[:, -1:, :]  # [H, 1, dk]
        S = GL.transpose(1, 2).exp() * S + (kc * (GL - G).exp()).transpose(1, 2) @ U
    return torch.cat(out, dim=0), S


def kda_forward(
    x: Tensor, w: dict[str, Tensor], cfg: KDAConfig, state: KDAState | None = None
) -> tuple[Tensor, KDAState]:
    """One KDA layer over one sequence's new tokens.

    Args:
        x: [T, hidden] activations (the layer's input after input_layernorm); the output has x's dtype.
        w: the layer's weights under their checkpoint names without the `model.layers.{i}.self_attn.` prefix.
        cfg: head count and width, conv kernel size, o_norm epsilon.
        state: the state after the previous tokens, or None at the start of the sequence. Not modified.
    Returns:
        (out [T, hidden], the state after these tokens).
    """
    T = x.shape[0]
    H, d = cfg.num_heads, cfg.head_dim
    if state is None:
        state = KDAState.empty(cfg, x.dtype, x.device)
    cd = _state_dtype(x.dtype)

    q, conv_q = short_conv(_linear(x, w["q_proj.weight"]), w["q_conv1d.weight"], state.conv_q)
    k, conv_k = short_conv(_linear(x, w["k_proj.weight"]), w["k_conv1d.weight"], state.conv_k)
    v, conv_v = short_conv(_linear(x, w["v_proj.weight"]), w["v_conv1d.weight"], state.conv_v)
    q = _l2norm(q.to(cd).reshape(T, H, d)) * d**-0.5
    k = _l2norm(k.to(cd).reshape(T, H, d))
    v = v.to(cd).reshape(T, H, d)
    g = kda_gate(x, w, cfg, cd)
    beta = torch.sigmoid(_linear(x, w["b_proj.weight"]).to(cd))

    recur = kda_recurrent if T == 1 else kda_chunked
    o, S = recur(q, k, v, g, beta, state.S.to(cd))

    if cfg.full_rank_gate:
        gate = _linear(x, w["g_proj.weight"]).view(T, H, d)
    else:
        gate = _linear(_linear(x, w["g_a_proj.weight"]), w["g_b_proj.weight"]).view(T, H, d)
    o = gated_rms_norm(o.to(x.dtype), gate, w["o_norm.weight"], cfg.eps)
    out = _linear(o.reshape(T, H * d), w["o_proj.weight"])
    return out, KDAState(conv_q, conv_k, conv_v, S)
