"""What the CPU's quantized decode rows compute, written in torch for the tests.

q4 (quant/q4_int8.py): W = (nibble - 8) s + z per group; full 64-row blocks of groups a multiple of 16 multiply the
(nibble - 8) s part by the row rounded to int8 per group and the zero points by the row itself; other rows take the
row as it is. q8 (quant/q8_numba.py): W = code x row scale; the row rounded to int8 in blocks of 32, the columns
past the last full block as they are."""
import torch


def int8_rounded(x: torch.Tensor, groups: int) -> torch.Tensor:
    """x [1, K] rounded as the kernel rounds it, in float32: per group of K / groups, scale = max |x| / 127,
    x -> round(x / scale) * scale."""
    g = x.view(groups, -1)
    d = g.abs().amax(1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(g * inv) * d).view_as(x)


def row_product(fmt, x: torch.Tensor, parts: dict, shape) -> torch.Tensor:
    """x [1, K] times the q4 matrix, float64, as the decode-row kernel defines it."""
    N, K = shape
    G = parts["sz"].shape[0]
    d = fmt.unpack(parts, shape, torch.float64)
    Z = parts["sz"][..., 1].double().T.repeat_interleave(K // G, 1)                  # [N, K]
    n8 = N // 64 * 64 if (K // G) % 16 == 0 else 0
    xr, x = int8_rounded(x, G).double(), x.double()
    return torch.cat([xr @ (d[:n8] - Z[:n8]).T + x @ Z[:n8].T, x @ d[n8:].T], 1)


def q8_row_product(fmt, x: torch.Tensor, parts: dict, shape) -> torch.Tensor:
    """x [1, K] times the q8 matrix, float64, as the decode-row kernel defines it."""
    N, K = shape
    nb = K // 32
    w = fmt.unpack(parts, shape, torch.float64)
    xr = torch.cat([int8_rounded(x[:, :nb * 32], nb), x[:, nb * 32:]], 1) if nb else x
    return xr.double() @ w.T
