"""The numba decode-row kernels of the CPU (layers/cpu_kernels.py, quant/q4_numba.py) against torch references, and
the rules that keep their bits fixed: a row's result depends neither on the thread count nor on what else is in the
batch, and a numba launch leaves torch's thread count alone."""
import pytest
import torch
import torch.nn.functional as F

from waste.layers import norm_cpu
from waste.quant import int4pack
from waste.quant.formats import get_format


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("shape", [(768, 2048), (80, 96), (64, 64), (16, 6)])
def test_q4_decode_row_is_the_float32_product_at_any_thread_count(shape, threads):
    from waste.quant import q4_numba

    fmt, g = get_format("q4"), torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) / shape[1] ** 0.5
    parts = fmt.pack(w)
    d = fmt.unpack(parts, shape, torch.float64)
    x = torch.randn(1, shape[1], generator=g)
    got = {}
    for n in (1, 2):
        torch.set_num_threads(n)
        got[n] = q4_numba.row(x, parts, shape)
        assert torch.get_num_threads() == n              # numba's launch left torch's count as it was
    ref = x.double() @ d.T
    assert ((got[1].double() - ref).norm() / ref.norm()).item() < 1e-6    # float32 throughout: no bf16 rounding
    assert torch.equal(got[1], got[2])                   # a block is one thread's, whatever the count
    if int4pack.native() or not int4pack.kernel_ok(*shape, fmt._group(parts, shape)):
        assert torch.equal(fmt.linear(x, parts, shape), got[1])      # Q4.linear's decode row takes this kernel


def test_rms_rows_match_torch_and_a_rows_bits_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    for h in (8, 320, 2048):
        x, w = torch.randn(5, h, generator=g), torch.randn(h, generator=g)
        got = norm_cpu.rms_rows(x, w, 1e-6)
        ref = F.rms_norm(x.double(), (h,), w.double(), 1e-6)
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-6
        for i in range(5):
            buf = torch.zeros(h + i + 3)                 # the row alone, at another address alignment
            buf[i:i + h] = x[i]
            assert torch.equal(norm_cpu.rms_rows(buf[i:i + h].view(1, h), w, 1e-6), got[i:i + 1])
    assert norm_cpu.rms_rows(torch.randn(2, 3, 8), torch.ones(8), 1e-6).shape == (2, 3, 8)


@pytest.mark.parametrize("shape", [(5120, 2048), (130, 70), (6, 64), (3, 16)])
def test_q8_decode_row_is_the_float32_product_at_any_thread_count(shape, threads):
    """A float32 decode row of a q8 matrix (a trunk row) reads the int8 codes in place (quant/q8_numba.py) instead of
    widening the whole matrix at every call; its bits do not depend on the thread count."""
    from waste.quant.linear import QuantWeight, linear

    fmt, g = get_format("q8"), torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) / shape[1] ** 0.5
    qw = QuantWeight(fmt, fmt.pack(w), shape)
    assert qw.row_kernel() is not None
    x = torch.randn(1, shape[1], generator=g)
    got = {}
    for n in (1, 2):
        torch.set_num_threads(n)
        got[n] = linear(x, qw)
        assert torch.get_num_threads() == n
    ref = x.double() @ qw.dequantize(torch.float64).T
    assert ((got[1].double() - ref).norm() / ref.norm()).item() < 1e-6
    assert torch.equal(got[1], got[2])
