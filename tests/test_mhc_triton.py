"""mHC's read side in one triton launch (layers/mhc_triton.py) against the torch path it replaces (layers/mhc.py).
Through triton's interpreter without a GPU (tests/conftest.py), compiled on one; on a GPU hc_split itself takes it."""
import pytest
import torch

pytest.importorskip("triton")
from test_moe_triton import DEV  # noqa: E402  (also patches the interpreter for numpy >= 2.4)

from waste.layers import mhc_triton  # noqa: E402
from waste.layers.mhc import MHCConfig, hc_split  # noqa: E402


def operands(T, n, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(T, n, D, generator=g).to(dtype)
    fn = torch.randn((2 + n) * n, n * D, generator=g) * 0.05
    base = torch.randn((2 + n) * n, generator=g)
    scale = torch.rand(3, generator=g) + 0.5
    return X, fn, base, scale


@pytest.mark.parametrize("T,n,D,dtype", [(1, 4, 1100, torch.bfloat16), (2, 4, 48, torch.float32),
                                         (3, 3, 700, torch.float32), (1, 2, 64, torch.bfloat16)])
def test_hc_tail_matches_the_torch_path(T, n, D, dtype):
    cfg = MHCConfig(n, 20, 1e-6, 1e-5)
    X, fn, base, scale = operands(T, n, D, dtype, seed=T * 100 + n)
    u_ref, post_ref, M_ref = hc_split(X, fn, base, scale, cfg)          # the CPU: torch's ops
    flat = X.reshape(T, n * D).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + cfg.norm_eps)
    a = torch.nn.functional.linear(flat, fn)
    u, post, M = mhc_triton.hc_tail(a.to(DEV), base.to(DEV), scale.to(DEV), X.to(DEV), cfg.sinkhorn_iters, cfg.eps)
    assert u.dtype == dtype and post.dtype == M.dtype == torch.float32
    assert torch.allclose(post.cpu(), post_ref, rtol=1e-6, atol=1e-7)
    assert torch.allclose(M.cpu(), M_ref, rtol=1e-5, atol=1e-7)
    assert torch.allclose(M.cpu().sum(-2), torch.ones(T, n), atol=1e-4)       # Sinkhorn ends on the columns
    # u is the same float32 sum of n terms in another order: a few float32 units at |u| <= 8 (2^-20); stored in
    # bf16 one unit apart at most (2^-7 relative: the interpreter truncates where torch rounds)
    if dtype == torch.bfloat16:
        assert torch.allclose(u.cpu().float(), u_ref.float(), rtol=2 ** -7, atol=1e-6)
    else:
        assert torch.allclose(u.cpu(), u_ref, rtol=1e-6, atol=2 ** -20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine (CI has none)")
def test_hc_split_on_a_gpu_takes_the_kernel_and_agrees():
    cfg = MHCConfig(4, 20, 1e-6, 1e-5)
    X, fn, base, scale = operands(1, 4, 4096, torch.bfloat16, seed=7)
    ref = hc_split(X, fn.bfloat16(), base, scale, cfg)
    got = hc_split(X.cuda(), fn.bfloat16().cuda(), base.cuda(), scale.cuda(), cfg)
    assert mhc_triton.usable(X.cuda())
    for r, o in zip(ref, got):
        assert torch.allclose(o.cpu().float(), r.float(), rtol=2 ** -7, atol=1e-3)
