"""quant/gemv_triton.py: a GPU decode row times a float trunk matrix, against float64's product. Through triton's
interpreter without a GPU (tests/conftest.py sets TRITON_INTERPRET=1), compiled on a GPU."""
import pytest
import torch

pytest.importorskip("triton")
from test_moe_triton import DEV  # noqa: E402  (also patches the interpreter for numpy >= 2.4)

from waste.quant import gemv_triton  # noqa: E402
from waste.quant.linear import linear  # noqa: E402


@pytest.mark.parametrize("N,K,dtype,bias", [(40, 96, torch.float32, False), (300, 1100, torch.bfloat16, True),
                                             (17, 64, torch.bfloat16, False)])
def test_row_matches_the_float64_product(N, K, dtype, bias):
    """Rows past a program's tile (N not a multiple of its rows, K of its columns) masked, the bias added in
    float32, one rounding to the row's dtype."""
    g = torch.Generator().manual_seed(N)
    w = torch.randn(N, K, generator=g).to(dtype).to(DEV)
    x = torch.randn(1, K, generator=g).to(dtype).to(DEV)
    b = torch.randn(N, generator=g).to(dtype).to(DEV) if bias else None
    y = gemv_triton.row(x, w, b)
    ref = x.double().cpu() @ w.double().cpu().T + (b.double().cpu() if bias else 0)
    assert y.shape == (1, N) and y.dtype == dtype
    err = ((y.double().cpu() - ref).abs() / (ref.abs() + 1)).max()
    assert err < (1e-6 if dtype == torch.float32 else 2 ** -7)


def test_tile_gives_enough_programs_and_bounded_steps():
    for N, K in ((5120, 2048), (2048, 4096), (151936, 2048), (7, 300)):
        bn, bk, _ = gemv_triton.tile_for(N, K)
        assert bn * bk <= 8192 and bk <= 2048 and bn >= 1
        assert -(-N // bn) >= min(gemv_triton.PROGRAMS, N) // 2 or bn == 1, (N, K, bn)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="linear routes only CUDA rows to it")
def test_linear_takes_it_for_a_cuda_row_and_matches_cublas():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(5120, 2048, generator=g).to(torch.bfloat16).cuda()
    x = torch.randn(1, 2048, generator=g).to(torch.bfloat16).cuda()
    assert gemv_triton.usable(x, w)
    y = linear(x, w)
    gemv_triton.ENABLED = False
    try:
        ref = linear(x, w)
    finally:
        gemv_triton.ENABLED = True
    assert ((y.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -6 + 1e-2).all()


def test_fast_launches_follow_alignment_and_give_the_jits_bits():
    """Rows of one matrix at 2-byte offsets (x and w views off 16-byte alignment: another specialization, so
    another key) give the bits of the JIT's launch of the same call; under CHECK (tests/conftest.py) each fast
    launch also asserts the JIT would have run its kernel. Interpreted: every call goes through the JIT."""
    from waste import triton_launch
    g = torch.Generator().manual_seed(2)
    base_w = torch.randn(64 * 300 + 8, generator=g).to(torch.bfloat16).to(DEV)
    base_x = torch.randn(300 + 8, generator=g).to(torch.bfloat16).to(DEV)
    out = {}
    for fast in (False, True):
        triton_launch.ENABLED = fast
        try:
            out[fast] = [gemv_triton.row(base_x[o:o + 300].view(1, 300), base_w[o:o + 64 * 300].view(64, 300))
                         for _ in range(2) for o in (0, 1, 8)]
        finally:
            triton_launch.ENABLED = True
    assert all(torch.equal(a, b) for a, b in zip(out[False], out[True]))
