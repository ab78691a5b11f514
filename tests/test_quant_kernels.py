"""The storage formats' kernels against their own unpacking, the q4 nibble layout against torch's int4 operand,
and q4's numba search against the same search written in torch."""
import pytest
import torch

from waste.default_model import BUNDLED
from waste.quant import int4pack
from waste.quant.formats import get_format
from waste.quant.quality import rel_error
from rowref import row_product


@pytest.mark.parametrize("name", ["q8", "q4", "q4g32", "q4g128", "vq3", "mxfp4"])
@pytest.mark.parametrize("shape", [(96, 256), (256, 96), (64, 32), (48, 64)])
def test_kernel_equals_unpacked_matmul(name, shape):
    fmt = get_format(name)
    if not fmt.supports(shape) or (name == "vq3" and shape[0] * shape[1] > 4096):   # k-means: keep it quick
        pytest.skip(f"{name} does not take {shape}")
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) / shape[1] ** 0.5
    parts = fmt.pack(w)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in parts.items()} == fmt.part_specs(shape)
    d = fmt.unpack(parts, shape, torch.float32)
    parts = fmt.prepare(parts, shape)          # linear() takes prepared parts (this torch's kernel layout)
    if name == "mxfp4":       # the numba unpacks against plain torch references, bit for bit
        from waste.quant.lowbit import mx_dequantize
        assert torch.equal(d, mx_dequantize(parts["blocks"], parts["scales"], *shape))
    if name == "vq3":
        b, c = parts["books"].float(), parts["codes"].long()
        ref_w = (b[0][c[..., 0]] + b[1][c[..., 1]] + b[2][c[..., 2]]).view(shape) * parts["scale"].float()[:, None]
        assert torch.equal(d, ref_w)
    assert rel_error(fmt, w) < {"q8": 0.01, "vq3": 0.25, "mxfp4": 0.15}.get(name, 0.1)
    # torch's int4 kernel takes float32 activations as bfloat16 (int4pack.int4_mm): x is rounded to bf16 (the
    # reference does the same) and so is the output, at most bf16's unit roundoff u = 2^-9 of it; one more u
    # for the kernel's own bf16 steps (measured worst 1.04 u over 30 seeds x 3 shapes x T = 1, 3, 9)
    bf16_kernel = name.startswith("q4") and int4pack.kernel_ok(*shape, fmt._group(parts, shape))
    gen = torch.Generator().manual_seed(1)
    for T in (1, 3, 9):
        x = torch.randn(T, shape[1], generator=gen)
        y = fmt.linear(x, parts, shape)
        assert y.dtype == torch.float32
        if T == 1 and name.startswith("q4") and fmt.row_kernel(parts, shape) is not None:
            ref, bf16 = row_product(fmt, x, parts, shape).float(), False    # the decode row: tests/rowref.py
        else:
            ref, bf16 = (x.bfloat16().float() if bf16_kernel else x) @ d.T, bf16_kernel
        assert ((y - ref).norm() / ref.norm()).item() < (2 * 2 ** -9 if bf16 else 0) + 1e-5
    yb = fmt.linear(x.bfloat16(), parts, shape)
    assert yb.dtype == torch.bfloat16 and ((yb.float() - x @ d.T).norm() / (x @ d.T).norm()).item() < 2e-2


def test_nibble_layout_is_torchs_int4pack_operand_and_repacks_elsewhere(monkeypatch):
    g = torch.Generator().manual_seed(1)
    for N, K in ((64, 64), (48, 32), (208, 96), (6, 8)):
        q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
        p = int4pack.pack_nibbles(q)
        assert torch.equal(int4pack.unpack_nibbles(p, N, K), q)
        assert torch.equal(int4pack.unpack_nibbles(int4pack.pack_nibbles(q, 32), N, K, 32), q)     # AVX2's blocks
        if int4pack.native() and N % 16 == 0:
            assert torch.equal(torch._convert_weight_to_int4pack_for_cpu(q.int(), 2).reshape(-1), p.reshape(-1))
    # bf16 rows: both layouts through torch's int4 kernel (float32 rows above one are unpacked: quant/q4_rows.py)
    fmt, w, x = get_format("q4"), torch.randn(96, 256, generator=g), torch.randn(2, 256, generator=g).bfloat16()
    parts = fmt.pack(w)
    y = fmt.linear(x, parts, (96, 256))
    monkeypatch.setattr(int4pack, "native", lambda: False)   # as on an AVX2 or ARM build: repack, same numbers
    assert torch.allclose(fmt.linear(x, fmt.prepare(parts, (96, 256)), (96, 256)).float(), y.float(), rtol=1e-5,
                          atol=1e-6)


def _q4_search_in_torch(x: torch.Tensor):
    """The q4 search of waste/quant/q4fit.py written as whole-tensor torch ops (how q4 was first built): x [N, G, g]
    -> codes, scale, zero. An independent reference for the numba kernel."""
    from waste.quant.intq import Q4_REFITS, Q4_SHRINK

    def codes_err(s, z):
        q = ((x - z[..., None]) / s[..., None] + 8).round().clamp(0, 15)
        return q, (((q - 8) * s[..., None] + z[..., None] - x) ** 2).sum(-1)

    mx, mn = x.amax(-1), x.amin(-1)
    c, h = (mx + mn) / 2, (mx - mn) / 2
    best = None
    for shrink in Q4_SHRINK:
        s = (2 * h * shrink / 15).clamp_min(1e-30).to(torch.bfloat16).float()
        z = (c - h * shrink + 8 * s).to(torch.bfloat16).float()
        q, e = codes_err(s, z)
        if best is None:
            best = [q, s, z, e]
            continue
        b = e < best[3]
        best = [torch.where(b[..., None], q, best[0]), torch.where(b, s, best[1]), torch.where(b, z, best[2]),
                torch.minimum(e, best[3])]
    q, s, z, e = best
    for _ in range(Q4_REFITS):
        cq = q - 8
        cm, xm = cq.mean(-1, keepdim=True), x.mean(-1, keepdim=True)
        var = ((cq - cm) ** 2).sum(-1)
        s2 = torch.where(var > 0, ((cq - cm) * (x - xm)).sum(-1) / var.clamp_min(1e-30), s).clamp_min(1e-30)
        s2 = s2.to(torch.bfloat16).float()
        z2 = (xm[..., 0] - s2 * cm[..., 0]).to(torch.bfloat16).float()
        q2, e2 = codes_err(s2, z2)
        b = e2 < e
        q, s, z, e = torch.where(b[..., None], q2, q), torch.where(b, s2, s), torch.where(b, z2, z), torch.minimum(e, e2)
    return q, s, z


def test_q4_fit_kernel_matches_the_torch_search():
    """The numba search picks the same codes as the same search in torch, on random and on the bundled model's
    weights; where float summation order flips a near-tie, the squared error stays the same to 1e-6."""
    from waste.convert.source import Checkpoint
    from waste.quant.intq import Q4_REFITS, Q4_SHRINK
    from waste.quant.q4fit import fit_groups

    ck = Checkpoint(BUNDLED)
    mats = [torch.randn(256, 1024, generator=torch.Generator().manual_seed(4)),
            ck.get("model.layers.3.mlp.experts.7.gate_proj.weight").float(),
            ck.get("model.layers.3.mlp.experts.7.down_proj.weight").float()]
    for w in mats:
        N, K = w.shape
        g = 64 if K % 64 == 0 else 32
        x = w.view(N, K // g, g)
        q, s, z = fit_groups(x, Q4_SHRINK, Q4_REFITS)
        rq, rs, rz = _q4_search_in_torch(x)
        same = (q.float() == rq).all(-1)
        assert same.float().mean() >= 0.999, same.float().mean()
        err = (((q.float() - 8) * s[..., None] + z[..., None] - x) ** 2).sum()
        ref = (((rq - 8) * rs[..., None] + rz[..., None] - x) ** 2).sum()
        assert abs(err - ref) <= 1e-6 * ref, (err, ref)
