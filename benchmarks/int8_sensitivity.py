"""How much the int8-rounded q8 trunk rows at prefill (quant/q8_rows.py) amplify a small difference upstream
(docs/LEARNED.md §10f): a 64-token prefill of a q4-experts + q8-trunk container (float32, 1 thread), its experts
through the exact float tiles or through torch's int4 kernel (x in bf16, as on an AVX2 build), with the trunk's
rows rounded to int8 or exact; relative logit differences and whether the argmax moved. The container's q8 matrices
must be above q8_rows.MIN_WEIGHTS for its first arm to round (the threshold is lowered here for the bundled model).

    python benchmarks/int8_sensitivity.py CONTAINER TEXT_FILE
"""
import sys

import torch

import waste
from waste.quant import q8_rows

torch.set_num_threads(1)
q8_rows.MIN_WEIGHTS = 1 << 16
serves = q8_rows.serves
with waste.load(sys.argv[1], dtype="float32", preload=False) as eng:
    m = eng.model
    ids = torch.tensor(eng.encode(open(sys.argv[2]).read())[:64])

    def run(tiles: bool, int8: bool) -> torch.Tensor:
        m.bank._rows_kernel = False if tiles else None
        q8_rows.serves = serves if int8 else (lambda N, K: False)
        return m.forward(ids, m.new_state(), 0)

    a, b, c, d = run(True, True), run(False, True), run(False, False), run(True, False)


def rel(x, y):
    return ((x - y).norm() / y.norm()).item()


print(f"int8 trunk: tiles vs int4 experts {rel(b, a):.5f} (argmax same: {torch.equal(a.argmax(-1), b.argmax(-1))})")
print(f"exact trunk: tiles vs int4 experts {rel(c, d):.5f} (argmax same: {torch.equal(c.argmax(-1), d.argmax(-1))})")
print(f"tiles experts: int8 vs exact trunk {rel(a, d):.5f}")
