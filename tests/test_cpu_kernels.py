"""The numba decode-row kernels of the CPU (layers/cpu_kernels.py, quant/q4_numba.py) against torch references, and
the rules that keep their bits fixed: a row's result depends neither on the thread count nor on what else is in the
batch, and a numba launch leaves torch's thread count alone."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from waste.layers import norm_cpu
from waste.quant.linear import linear
from waste.quant import int4pack
from waste.quant.formats import get_format
from rowref import int8_rounded, q8_row_product, row_product


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("shape", [(768, 2048), (2048, 768), (80, 96), (64, 64), (16, 6)])
def test_q4_decode_row_is_the_product_with_the_int8_rounded_row_at_any_thread_count(shape, threads):
    from waste.quant import q4_numba

    fmt, g = get_format("q4"), torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) / shape[1] ** 0.5
    parts = fmt.pack(w)
    d = fmt.unpack(parts, shape, torch.float64)
    x = torch.randn(1, shape[1], generator=g)
    got = {}
    for n in (1, 2, 1):
        torch.set_num_threads(n)
        got.setdefault(n, []).append(q4_numba.row(x, parts, shape))
        assert torch.equal(got[n][-1], got[1][0])        # a block is one thread's, whatever the count
        assert torch.equal(torch.tensor(torch.get_num_threads()), torch.tensor(n))   # numba left torch's count
    G = parts["sz"].shape[0]
    xr = int8_rounded(x, G).double()                     # within half a step of x
    assert ((xr - x.double()).abs() <= x.view(G, -1).abs().amax(1).repeat_interleave(shape[1] // G) / 254 + 1e-7).all()
    ref = row_product(fmt, x, parts, shape)
    assert ((got[1][0].double() - ref).norm() / ref.norm()).item() < 1e-6    # integer sums, one float32 epilogue
    if int4pack.native() or not int4pack.kernel_ok(*shape, fmt._group(parts, shape)):
        assert torch.equal(fmt.linear(x, parts, shape), got[1][0])   # Q4.linear's decode row takes this kernel


# (4096, 512), (601, 224), (530, 200): above q8_numba.VNNI_MIN (the VNNI row where the host has it: an even and an
# odd count of 32-blocks, a row count past whole passes and tasks, a K past the last block); the rest below it
@pytest.mark.parametrize("shape", [(4096, 512), (601, 224), (530, 200), (96, 320), (320, 96), (130, 70), (16, 40),
                                   (6, 64), (8, 16), (3, 16)])
def test_q8_decode_row_is_the_product_with_the_int8_rounded_row_at_any_thread_count(shape, threads):
    from waste.quant.linear import QuantWeight

    fmt, g = get_format("q8"), torch.Generator().manual_seed(3)
    parts = fmt.pack(torch.randn(shape, generator=g) / shape[1] ** 0.5)
    w = QuantWeight(fmt, parts, shape)
    x = torch.randn(1, shape[1], generator=g)
    got = []
    for n in (1, 2, 1):
        torch.set_num_threads(n)
        got.append(linear(x, w))                         # a trunk's float32 decode row takes quant/q8_numba.py
    assert w.row_kernel() is not None
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
    ref = q8_row_product(fmt, x, parts, shape)
    assert ((got[0].double() - ref).norm() / ref.norm()).item() < 1e-6    # integer sums, float32 block scales
    assert ((got[0].double() - x.double() @ fmt.unpack(parts, shape, torch.float64).T).norm() / ref.norm()) < 2e-2
    exact = x.double() @ fmt.unpack(parts, shape, torch.float64).T   # the format's own linear: x itself (experts)
    assert ((fmt.linear(x, parts, shape).double() - exact).norm() / exact.norm()).item() < 1e-6


@pytest.mark.parametrize("shape", [(5120, 2048), (601, 224), (530, 200), (4096, 512)])
def test_q8_rows_shared_with_a_helper_thread_are_the_rows_of_one(shape, threads):
    """numba_ptr.row_helper: a VNNI q8 row's chunks taken from one queue by this thread and a pool's (whichever is
    running takes the next) are the same bits as the kernel alone, however the chunks fell between them."""
    from concurrent.futures import ThreadPoolExecutor

    from waste import numba_ptr
    from waste.quant import q4_vnni
    from waste.quant.linear import QuantWeight

    if not q4_vnni.available():
        pytest.skip("no AVX-512 VNNI: the q8 rows have no shared kernel")
    torch.set_num_threads(1)
    fmt, g = get_format("q8"), torch.Generator().manual_seed(5)
    w = QuantWeight(fmt, fmt.pack(torch.randn(shape, generator=g) / shape[1] ** 0.5), shape)
    xs = [torch.randn(1, shape[1], generator=g) for _ in range(3)]
    ref = [linear(x, w) for x in xs]
    assert w.row_kernel().shared is not None
    with ThreadPoolExecutor(1) as pool, numba_ptr.row_helper(pool):
        got = [[linear(x, w) for x in xs] for _ in range(20)]
    assert all(torch.equal(a, b) for run in got for a, b in zip(run, ref))


def test_bf16_decode_rows_take_the_float32_kernels_rounded():
    """A bf16 row (the compute dtype above 2 GiB) goes through the same numba kernels, widened and rounded back."""
    from waste.quant.linear import QuantWeight

    g = torch.Generator().manual_seed(4)
    for name, shape in (("q4", (128, 256)), ("q8", (96, 320))):
        fmt = get_format(name)
        w = QuantWeight(fmt, fmt.pack(torch.randn(shape, generator=g)), shape)
        x = torch.randn(1, shape[1], generator=g).bfloat16()
        y = linear(x, w)
        assert y.dtype == torch.bfloat16 and torch.equal(y, linear(x.float(), w).bfloat16())


def _q4_records(fmt, g, h, inter, E):
    """E random q4 expert records as the pair kernels read them: (shapes, packed parts, the flat part arrays, their
    (offset, stride) table, each matrix's group count)."""
    shapes = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    packed = {m: [fmt.pack(torch.randn(shp, generator=g) / shp[1] ** 0.5) for _ in range(E)] for m, shp in shapes.items()}
    arrays, os = [], []
    for m in shapes:
        for key in ("q", "sz"):
            t = torch.stack([p[key] for p in packed[m]]).contiguous()
            a = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
            arrays.append(a.reshape(-1))
            os.append((0, t[0].numel()))
    groups = np.array([packed[m][0]["sz"].shape[0] for m in shapes], np.int64)
    return shapes, packed, arrays, np.array(os, np.int64), groups


def test_q4_expert_pairs_are_each_pairs_int8_product_at_any_thread_count(threads):
    """layers/cpu_kernels.py pairs_q4: gate and up take the row rounded to int8 once, down its pair's own SwiGLU
    output rounded alike; a pair's bits do not depend on the thread count or the other pairs of the call."""
    from waste.layers import cpu_kernels as ck

    fmt, g = get_format("q4"), torch.Generator().manual_seed(1)
    h, inter, E = 256, 192, 4
    shapes, packed, arrays, os, groups = _q4_records(fmt, g, h, inter, E)
    x = torch.randn(1, h, generator=g)

    def call(slots):
        s = torch.tensor([slots], dtype=torch.int64)
        out = np.zeros((len(slots), h), np.float32)
        ck.pairs_q4(x.data_ptr(), h, s.data_ptr(), len(slots), *arrays, os, groups, inter, np.float32(-1), out)
        return torch.from_numpy(out)

    torch.set_num_threads(2)
    both = call([2, 0, 3])
    torch.set_num_threads(1)
    assert torch.equal(call([2, 0, 3]), both)
    assert torch.equal(call([0])[0], both[1])            # a pair alone: the same bits
    for i, e in enumerate((2, 0, 3)):
        def mv(m, v):                                    # the kernel's product of the matrix m with row v
            return row_product(fmt, v, packed[m][e], shapes[m])

        ref = mv("down", (F.silu(mv("gate", x)) * mv("up", x)).float())
        assert ((both[i].double() - ref[0]).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("h,inter,limit", [(256, 192, -1.0), (512, 128, 7.0), (64, 32, -1.0), (128, 96, 7.0)])
def test_a_q4_pair_shared_block_by_block_with_a_helper_is_the_pair_of_one_thread(h, inter, limit):
    """layers/cpu_kernels.py pair_q4_shared (a streamed layer's lone pair on both threads, moe_cpu.into_shared): its
    64-row blocks taken from one queue by the caller and a helper thread, on time, late (the queue spent) or never,
    give pairs_q4's bits for that pair (full 64-row blocks by int8, and tail blocks by the float loop)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from waste.layers import cpu_kernels as ck

    fmt, g = get_format("q4"), torch.Generator().manual_seed(2)
    E = 3
    _, _, arrays, os, groups = _q4_records(fmt, g, h, inter, E)
    x = torch.randn(1, h, generator=g)
    lim = np.float32(limit)
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(1)
    try:
        for e in range(E):
            s = torch.tensor([[e]], dtype=torch.int64)
            ref = np.zeros((1, h), np.float32)
            ck.pairs_q4(x.data_ptr(), h, s.data_ptr(), 1, *arrays, os, groups, inter, lim, ref)
            for helper in ("on time", "late", "never"):
                out, gu, q = np.zeros((1, h), np.float32), np.empty((2, inter), np.float32), np.zeros(2, np.int64)
                args = (x.data_ptr(), h, e, *arrays, os, groups, inter, lim, out[0].ctypes.data, gu[0].ctypes.data,
                        gu[1].ctypes.data, q.ctypes.data)
                go = threading.Event()
                if helper != "never":
                    f = pool.submit(lambda: (go.wait(), ck.pair_q4_shared(*args, True)))
                if helper == "on time":
                    go.set()
                ck.pair_q4_shared(*args, False)
                go.set()
                if helper != "never":
                    f.result()
                assert q[1] == -(-inter // 64) - (-h // 64), helper
                assert np.array_equal(out, ref), (e, helper)
    finally:
        pool.shutdown()


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


def test_bf16_rms_rows_are_the_bf16_lines_and_a_rows_bits_do_not_depend_on_the_batch():
    """A bf16 row's norm: x / rms(x) rounded to bf16, times the bf16 weight, rounded again (norm.py's lines in torch,
    which only the float32 sum's order can move: by one bf16 step at most, rarely)."""
    from waste.layers.norm import rms_norm

    g = torch.Generator().manual_seed(1)
    for h, wdt in ((8, torch.bfloat16), (320, torch.float32), (2048, torch.bfloat16), (2048, torch.float32)):
        # the weight in bf16, or float32 (a bf16 model's trunk keeps its norms so): used as rounded to bf16
        x, w = torch.randn(5, h, generator=g).bfloat16(), (1 + torch.randn(h, generator=g) / 4).to(wdt)
        got = norm_cpu.rms_rows(x, w, 1e-6)
        assert got.dtype == torch.bfloat16 and torch.equal(rms_norm(x, w, 1e-6), got)     # norm.py takes it
        xf = x.float()
        lines = w.bfloat16() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
        step = (lines.float().abs() * 2 ** -7).clamp_min(1e-30)             # one bf16 step (8-bit significand)
        off = (got.float() - lines.float()).abs()
        assert (off <= step).all() and (off > 0).float().mean() < 0.02
        for i in range(5):
            buf = torch.zeros(h + i + 3, dtype=torch.bfloat16)              # the row alone, at another alignment
            buf[i:i + h] = x[i]
            assert torch.equal(norm_cpu.rms_rows(buf[i:i + h].view(1, h), w, 1e-6), got[i:i + 1])


def test_bf16_weighted_row_is_the_float32_sum_rounded_once():
    """layers/moe.py weighted_sum of a bf16 decode row: the pairs widened, summed in float32 in ascending k, rounded
    once to bf16 (as the bmm of the widened pairs then the cast it replaces, within that rounding)."""
    from waste.layers.moe import weighted_sum

    g = torch.Generator().manual_seed(2)
    for k, h in ((8, 2048), (2, 64), (1, 8)):
        y, w = torch.randn(1, k, h, generator=g).bfloat16(), torch.rand(1, k, generator=g)
        got = weighted_sum(y, w)
        exact = (w.double().unsqueeze(-1) * y.double()).sum(1)
        assert got.dtype == torch.bfloat16 and got.shape == (1, h)
        ref = torch.bmm(w.unsqueeze(1), y.float()).squeeze(1)
        assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-5).all()     # half a bf16 step
        assert ((got.float() - ref.bfloat16().float()).abs() <= ref.abs() * 2 ** -7 + 1e-30).all()
        assert (got != ref.bfloat16()).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_decode_row_against_float64_and_its_cache_write(dtype, threads):
    """layers/attention_cpu.py: q/k norm, rotary, the cache write and attention of one row. A bf16 row (models above
    2 GiB) runs the same float32 kernel over its bf16 cache: the key and value it writes are the float32 ones
    rounded to nearest even, and it attends over the cache as stored."""
    from waste.layers import attention_cpu

    g = torch.Generator().manual_seed(5)
    H, G, d, n, cap = 4, 2, 16, 6, 10
    qkv = torch.randn(1, (H + 2 * G) * d, generator=g).to(dtype)
    qn, kn = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype), (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    ang = torch.rand(d // 2, generator=g) * 3
    cos, sin = torch.cat([ang.cos(), ang.cos()]).to(dtype), torch.cat([ang.sin(), ang.sin()]).to(dtype)
    K, V = torch.randn(cap, G, d, generator=g).to(dtype), torch.randn(cap, G, d, generator=g).to(dtype)
    K0, V0 = K.clone(), V.clone()
    torch.set_num_threads(2)
    out = attention_cpu.gqa_row(qkv, H, G, qn, kn, 1e-6, cos, sin, K, V, n)
    assert out.dtype == dtype

    def norm_rope(t, w):                                 # float64, rotate-half
        t = t.double()
        t = t / (t.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()
        half = d // 2
        rot = torch.cat([-t[..., half:], t[..., :half]], -1)
        return t * cos.double() + rot * sin.double()

    x = qkv.view(H + 2 * G, d)
    k_new, v_new = norm_rope(x[H:H + G], kn), x[H + G:].double()
    # the row's key and value land at n; a bf16 cache gets the float32 kernel's values rounded to nearest even
    assert ((K[n].double() - k_new).norm() / k_new.norm()).item() < (1e-6 if dtype == torch.float32 else 2 ** -8)
    assert torch.equal(V[n], v_new.to(dtype))
    if dtype == torch.bfloat16:
        Kf, Vf = K0.float(), V0.float()
        attention_cpu.gqa_row(qkv.float(), H, G, qn.float(), kn.float(), 1e-6, cos.float(), sin.float(), Kf, Vf, n)
        assert torch.equal(K[n], Kf[n].to(dtype))
    assert torch.equal(K[:n], K0[:n]) and torch.equal(K[n + 1:], K0[n + 1:]) and torch.equal(V[:n], V0[:n])
    q = norm_rope(x[:H], qn)
    Kd, Vd = K[:n + 1].double(), V[:n + 1].double()
    ref = torch.stack([torch.softmax(Kd[:, h // (H // G)] @ q[h] / d ** 0.5, 0) @ Vd[:, h // (H // G)]
                       for h in range(H)]).view(1, H * d)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    assert ((out.double() - ref).norm() / ref.norm()).item() < tol
    torch.set_num_threads(1)
    K[n], V[n] = K0[n], V0[n]
    assert torch.equal(attention_cpu.gqa_row(qkv, H, G, qn, kn, 1e-6, cos, sin, K, V, n), out)   # heads: same bits


def test_exact_helpers_never_inherit_fast_math():
    """numba compiles a helper whose `fastmath` is not set with the flags of the first kernel that calls it (its
    options inherit from the caller being compiled): quantize_row and act, shared by fast-math decode kernels and the
    prefill kernels, would then have bits that depend on which kernel a process compiled first (docs/LEARNED.md
    §10f). They set fastmath=False themselves; here a fast-math caller compiles first and their IR stays exact."""
    import numba

    from waste.layers.cpu_kernels import act
    from waste.quant.q4_int8 import quantize_row
    from waste.quant.q4_rows import block_rows

    for f in (act, quantize_row, block_rows):
        assert f.targetoptions.get("fastmath") is False, f.__name__

    @numba.njit(fastmath=True)
    def caller(x, xq, d, e, s):
        quantize_row(x, 4, xq, d, e, s)
        return act(x[0], x[1], np.float32(-1.0))

    x = np.random.default_rng(0).standard_normal(128).astype(np.float32)
    d, e, s = (np.empty(4, np.float32) for _ in range(3))
    caller(x, np.empty(128, np.int8), d, e, s)
    for f in (act, quantize_row):
        for ir in f.inspect_llvm().values():
            assert " fast " not in ir and "reassoc" not in ir, f.__name__
