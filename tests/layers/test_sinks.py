"""gpt-oss's sink attention (layers/sinks.py) against a float64 loop written from its definition: per query, the
softmax over the keys it may see plus the head's sink logit, the sink's share dropped."""
import math

import pytest
import torch

from waste.layers.sinks import sink_attend


def reference(q, k, v, sinks, scale, start, window):
    T, H, d = q.shape
    G = k.shape[1]
    out = torch.zeros(T, H, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        pos = start + t
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(H):
            g = h // (H // G)
            s = [float(q[t, h].double() @ k[j, g].double()) * scale for j in range(lo, pos + 1)]
            m = max(s + [float(sinks[h])])
            e = [math.exp(x - m) for x in s]
            z = sum(e) + math.exp(float(sinks[h]) - m)
            out[t, h] = sum(w / z * v[j, g].double() for w, j in zip(e, range(lo, pos + 1)))
    return out


@pytest.mark.parametrize("start,T,window", [(0, 9, None), (0, 9, 4), (5, 1, 4), (3, 6, 3), (0, 1, 1)])
def test_sink_attend_matches_its_definition(start, T, window):
    g = torch.Generator().manual_seed(start * 10 + T)
    H, G, d = 4, 2, 8
    q = torch.randn(T, H, d, generator=g)
    k, v = torch.randn(start + T, G, d, generator=g), torch.randn(start + T, G, d, generator=g)
    sinks = torch.randn(H, generator=g) * 2
    got = sink_attend(q, k, v, sinks, d ** -0.5, start, window)
    want = reference(q, k, v, sinks, d ** -0.5, start, window)
    assert torch.allclose(got.double(), want, atol=1e-6, rtol=1e-5)
