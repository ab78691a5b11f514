"""A quantized trunk matrix read from safetensors can start at any byte; the int8 kernel with bfloat16
activations crashed on such a part (segfault), so QuantWeight realigns. Run in a child process: a crash must
fail this test, not take the test session down."""
import subprocess
import sys

CHILD = r"""
import torch
from waste.quant.formats import get_format
from waste.quant.linear import QuantWeight, linear
fmt = get_format("q8")
w = torch.randn(512, 2048)
parts = fmt.pack(w)
raw = torch.empty(parts["q"].numel() + 64, dtype=torch.int8)
q = raw[8:8 + parts["q"].numel()].view(512, 2048)          # 8 bytes past a 64-byte boundary
q.copy_(parts["q"])
assert q.data_ptr() % 64 != 0
qw = QuantWeight(fmt, {"q": q, "scale": parts["scale"]}, (512, 2048))
x = torch.randn(5, 2048).bfloat16()
y = linear(x, qw)
ref = linear(x, QuantWeight(fmt, {"q": parts["q"].clone(), "scale": parts["scale"]}, (512, 2048)))
assert torch.equal(y, ref)
print("ok")
"""


def test_unaligned_q8_part_with_bfloat16_activations():
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                       env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stderr[-2000:])
