"""The triton expert kernels (layers/moe_triton.py) against each format's own unpack, per pair, for every format
kind they serve. Runs through triton's interpreter on a machine without a GPU (TRITON_INTERPRET=1, which
tests/conftest.py sets for the session; triton is in the test extra) and compiled on a GPU machine."""
import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU: TRITON_INTERPRET=1 (tests/conftest.py sets it) runs the kernels in triton's interpreter",
                allow_module_level=True)

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime import interpreter as _interp

    _patch = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):      # triton 3.6's interpreter takes int() of a 1-element array,
        _patch(tensor, scope)                   # which numpy >= 2.4 refuses: the scalar through .item()
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    _interp._patch_lang_tensor = _patch_lang_tensor

from waste.container.bank import _DTYPES, RecordLayout  # noqa: E402
from waste.layers.moe import MATRICES, Bank  # noqa: E402
from waste.layers import moe_triton, q4_rows  # noqa: E402
from waste.quant.formats import get_format  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def slab_bank(fmt_name: str, h: int, inter: int, n_slots: int, seed: int = 0):
    """n_slots random records of one format in a slab, as the expert store's make_bank views them, and the
    float matrices each record holds (through the format's own unpack)."""
    fmt = get_format(fmt_name)
    shapes = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    g = torch.Generator().manual_seed(seed)
    recs, dense = [], []
    for _ in range(n_slots):
        t, d = {}, {}
        for m in MATRICES:
            parts = fmt.pack(torch.randn(shapes[m], generator=g) / h ** 0.5)
            t.update({f"{m}.{k}" if k else m: v for k, v in parts.items()})
            d[m] = fmt.unpack(parts, shapes[m], torch.float32)
        recs.append(t)
        dense.append(d)
    layout = RecordLayout.from_tensors(recs[0])
    pad = layout.record_bytes - layout.payload_bytes
    rows = torch.from_numpy(np.stack([np.pad(layout.pack(r), (0, pad)) for r in recs])).to(DEV)
    if fmt.kind == "q4":        # the GPU slab's own layout, as the expert store rewrites a record landing there
        q4_rows.device_layout(layout, fmt)(rows, range(n_slots))
    parts = {m: {} for m in MATRICES}
    for p in layout.parts:
        m, _, suffix = p.name.partition(".")
        parts[m][suffix] = rows[:, p.offset:p.offset + p.nbytes].view(_DTYPES[p.dtype]).view(n_slots, *p.shape)
    return Bank(parts, shapes, fmt), dense


@pytest.mark.parametrize("fmt,h,inter", [("bf16", 64, 32), ("f32", 48, 40), ("q8", 64, 32), ("q4", 128, 96),
                                         ("q4", 256, 128), ("q4g32", 64, 32), ("q4", 24, 16), ("mxfp4", 64, 96)])
def test_pairs_match_unpacked_matrices(fmt, h, inter):
    """q4 at 128 x 96: gate and up with a tail block (96 rows) in the stored layout; 24 x 16: groups of 8 and 16."""
    bank, dense = slab_bank(fmt, h, inter, n_slots=5)
    x = torch.randn(1, h, generator=torch.Generator().manual_seed(1)).to(DEV)
    slots = torch.tensor([[3, 0, -1, 4, 3]], device=DEV)    # a slot twice: pairs are independent; -1: not held
    check_pairs(bank, dense, x, slots, h, fmt)


def check_pairs(bank, dense, x, slots, h, fmt):
    y = moe_triton.pairs(x, slots, bank, bn=16, bk=32)
    assert y.shape == (1, 5, h) and y.dtype == x.dtype
    assert not y[0, 2].any()
    kd = bank.fmt.kernel_dtype
    xr = (x if kd is None else x.to(kd)).float().cpu()[0]
    for j, s in enumerate(slots[0].tolist()):
        if s < 0:
            continue
        d = dense[s]
        g, u = d["gate"] @ xr, d["up"] @ xr
        if kd is not None:          # q4: rows in the kernel dtype between the launches, activated in it
            a = bank.activate(g.to(kd), u.to(kd)).float()
        else:
            a = bank.activate(g, u)
        ref = d["down"] @ a
        err = (y[0, j].float().cpu() - ref).norm() / ref.norm()
        # float / q8: float32 throughout, only the summation order differs; q4: four bf16 roundings (x, gate and
        # up, the activation, the output) of 2^-8 each on either side
        assert err < (2e-2 if kd is not None else 1e-5), (fmt, j, float(err))


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_rows_of_a_prefill_are_each_pairs_own(fmt):
    """Several rows (prefill of a packed format): each row's pairs equal that row computed alone."""
    bank, _ = slab_bank(fmt, 64, 64, n_slots=4)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(DEV)
    slots = torch.tensor([[1, 2], [0, 3], [2, -1]], device=DEV)
    y = moe_triton.pairs(x, slots, bank)
    for t in range(3):
        assert torch.equal(y[t], moe_triton.pairs(x[t:t + 1], slots[t:t + 1], bank)[0])
    assert not y[2, 1].any()
