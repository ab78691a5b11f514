"""The q4 matrix-vector loop shapes tried for quant/q4_numba.py (docs/LEARNED.md §10, "q4 at a decode row"): one
768 x 2048 q4 matrix (int4pack's layout, 64-row blocks, groups of 64) times one float32 row, one thread, median us
and GB/s of nibbles, and the error against a dequantized numpy product. `asm` prints the vector instructions of the
kept float variant (v4): the lane widths say why each shape is as fast as it is. `i8` is the kernel kept after them
(docs/LEARNED.md §10d: the row rounded to int8 per group, 16-bit integer lanes; its error is that rounding's).

    python benchmarks/q4_matvec.py N K [asm]          # e.g. 768 2048
"""
import re
import sys
import time

import numba
import numpy as np
N, K, G = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[2]) // 64
rng = np.random.default_rng(0)
q = rng.integers(0, 256, N * K // 2, dtype=np.uint8)
szs = rng.integers(0, 2**15, G * N * 2, dtype=np.uint16) & np.uint16(0x3fff)
x = rng.standard_normal(K).astype(np.float32)
sf = (szs.astype(np.uint32) << 16).view(np.float32)

# reference: dequant then dot (numpy)
def ref():
    W = np.zeros((N, K), np.float32)
    s = (szs.astype(np.uint32) << 16).view(np.float32).reshape(G, N, 2)
    gs = K // G
    for b in range(N // 64):
        blk = q[b * 64 * K // 2:(b + 1) * 64 * K // 2].reshape(K, 32)
        lo, hi = (blk & 15).astype(np.float32), (blk >> 4).astype(np.float32)
        W[b * 64:b * 64 + 32] = lo.T; W[b * 64 + 32:b * 64 + 64] = hi.T
    for g in range(G):
        W[:, g * gs:(g + 1) * gs] = (W[:, g * gs:(g + 1) * gs] - 8) * s[g, :, 0:1] + s[g, :, 1:2]
    return W @ x

@numba.njit(fastmath=True)
def v0(q, szs, G, x, y, acc):   # the kernel's loop shape before (quant/q4_numba.py keeps it for odd groups)
    N, K = y.shape[0], x.shape[0]
    gs = K // G
    for n in range(N):
        y[n] = 0.0
    for b in range(N // 64):
        hb = 32
        base = b * 64 * K // 2
        for g in range(G):
            for j in range(64):
                acc[j] = 0.0
            sx = np.float32(0.0)
            for k in range(g * gs, g * gs + gs):
                xk = x[k]
                sx += xk
                col = q[base + k * hb:base + k * hb + hb]
                for j in range(hb):
                    c = col[j]
                    acc[j] += np.float32(c & 15) * xk
                    acc[hb + j] += np.float32(c >> 4) * xk
            for j in range(64):
                n = b * 64 + j
                z = (g * N + n) * 2
                y[n] += szs[z] * (acc[j] - np.float32(8.0) * sx) + szs[z + 1] * sx

@numba.njit(fastmath=True)
def v1(q, szs, G, x, y, acc):   # 2-D block view [K, 32], constant inner width, separate lo/hi accumulators
    N, K = y.shape[0], x.shape[0]
    gs = K // G
    for n in range(N):
        y[n] = 0.0
    lo = np.empty(32, np.float32); hi = np.empty(32, np.float32)
    for b in range(N // 64):
        blk = q[b * 32 * K:(b + 1) * 32 * K].reshape((K, 32))
        for g in range(G):
            lo[:] = 0.0; hi[:] = 0.0
            sx = np.float32(0.0)
            for k in range(g * gs, g * gs + gs):
                xk = x[k]
                sx += xk
                row = blk[k]
                for j in range(32):
                    c = np.int32(row[j])
                    lo[j] += np.float32(c & 15) * xk
                    hi[j] += np.float32(c >> 4) * xk
            for j in range(64):
                n = b * 64 + j
                z = (g * N + n) * 2
                a = lo[j] if j < 32 else hi[j - 32]
                y[n] += szs[z] * (a - np.float32(8.0) * sx) + szs[z + 1] * sx

@numba.njit(fastmath=True)
def v2(q, szs, G, x, y, acc):   # widen a group's bytes to int16 lanes, int dot in float via two k at a time
    N, K = y.shape[0], x.shape[0]
    gs = K // G
    for n in range(N):
        y[n] = 0.0
    lo = np.empty(32, np.float32); hi = np.empty(32, np.float32)
    for b in range(N // 64):
        blk = q[b * 32 * K:(b + 1) * 32 * K].reshape((K, 32))
        for g in range(G):
            lo[:] = 0.0; hi[:] = 0.0
            sx = np.float32(0.0)
            for k in range(g * gs, g * gs + gs, 2):
                x0 = x[k]; x1 = x[k + 1]
                sx += x0 + x1
                r0 = blk[k]; r1 = blk[k + 1]
                for j in range(32):
                    c0 = np.int32(r0[j]); c1 = np.int32(r1[j])
                    lo[j] += np.float32(c0 & 15) * x0 + np.float32(c1 & 15) * x1
                    hi[j] += np.float32(c0 >> 4) * x0 + np.float32(c1 >> 4) * x1
            for j in range(64):
                n = b * 64 + j
                z = (g * N + n) * 2
                a = lo[j] if j < 32 else hi[j - 32]
                y[n] += szs[z] * (a - np.float32(8.0) * sx) + szs[z + 1] * sx


@numba.njit(fastmath=True)
def v3(q, szs, G, x, y, acc):   # v1 with the nibble arithmetic kept in 8/32-bit lanes
    N, K = y.shape[0], x.shape[0]
    gs = K // G
    for n in range(N):
        y[n] = 0.0
    lo = np.empty(32, np.float32); hi = np.empty(32, np.float32)
    m15 = np.uint8(15); s4 = np.uint8(4)
    for b in range(N // 64):
        blk = q[b * 32 * K:(b + 1) * 32 * K].reshape((K, 32))
        for g in range(G):
            lo[:] = 0.0; hi[:] = 0.0
            sx = np.float32(0.0)
            for k in range(g * gs, g * gs + gs):
                xk = x[k]
                sx += xk
                row = blk[k]
                for j in range(32):
                    c = row[j]
                    lo[j] += np.float32(np.int32(c & m15)) * xk
                    hi[j] += np.float32(np.int32(c >> s4)) * xk
            for j in range(64):
                n = b * 64 + j
                z = (g * N + n) * 2
                a = lo[j] if j < 32 else hi[j - 32]
                y[n] += szs[z] * (a - np.float32(8.0) * sx) + szs[z + 1] * sx


@numba.njit(fastmath=True)
def v4(q, szs, G, x, y, acc):   # v3 with four k per pass over the accumulators
    N, K = y.shape[0], x.shape[0]
    gs = K // G
    for n in range(N):
        y[n] = 0.0
    lo = np.empty(32, np.float32); hi = np.empty(32, np.float32)
    m15 = np.uint8(15); s4 = np.uint8(4)
    for b in range(N // 64):
        blk = q[b * 32 * K:(b + 1) * 32 * K].reshape((K // 4, 128))
        for g in range(G):
            lo[:] = 0.0; hi[:] = 0.0
            sx = np.float32(0.0)
            for k4 in range(g * gs // 4, (g * gs + gs) // 4):
                x0 = x[4 * k4]; x1 = x[4 * k4 + 1]; x2 = x[4 * k4 + 2]; x3 = x[4 * k4 + 3]
                sx += (x0 + x1) + (x2 + x3)
                row = blk[k4]
                for j in range(32):
                    c0 = row[j]; c1 = row[32 + j]; c2 = row[64 + j]; c3 = row[96 + j]
                    lo[j] += (np.float32(np.int32(c0 & m15)) * x0 + np.float32(np.int32(c1 & m15)) * x1) + (np.float32(np.int32(c2 & m15)) * x2 + np.float32(np.int32(c3 & m15)) * x3)
                    hi[j] += (np.float32(np.int32(c0 >> s4)) * x0 + np.float32(np.int32(c1 >> s4)) * x1) + (np.float32(np.int32(c2 >> s4)) * x2 + np.float32(np.int32(c3 >> s4)) * x3)
            for j in range(64):
                n = b * 64 + j
                z = (g * N + n) * 2
                a = lo[j] if j < 32 else hi[j - 32]
                y[n] += szs[z] * (a - np.float32(8.0) * sx) + szs[z + 1] * sx


@numba.njit(fastmath=True)
def v5(q, szs, G, x, y, acc):   # v4 with eight k per pass
    N, K = y.shape[0], x.shape[0]
    gs = K // G
    for n in range(N):
        y[n] = 0.0
    lo = np.empty(32, np.float32); hi = np.empty(32, np.float32)
    m15 = np.uint8(15); s4 = np.uint8(4)
    for b in range(N // 64):
        blk = q[b * 32 * K:(b + 1) * 32 * K].reshape((K // 8, 256))
        for g in range(G):
            lo[:] = 0.0; hi[:] = 0.0
            sx = np.float32(0.0)
            for k8 in range(g * gs // 8, (g * gs + gs) // 8):
                xs = x[8 * k8:8 * k8 + 8]
                x0 = xs[0]; x1 = xs[1]; x2 = xs[2]; x3 = xs[3]; x4 = xs[4]; x5 = xs[5]; x6 = xs[6]; x7 = xs[7]
                sx += ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
                row = blk[k8]
                for j in range(32):
                    c0 = row[j]; c1 = row[32 + j]; c2 = row[64 + j]; c3 = row[96 + j]
                    c4 = row[128 + j]; c5 = row[160 + j]; c6 = row[192 + j]; c7 = row[224 + j]
                    lo[j] += ((np.float32(np.int32(c0 & m15)) * x0 + np.float32(np.int32(c1 & m15)) * x1) + (np.float32(np.int32(c2 & m15)) * x2 + np.float32(np.int32(c3 & m15)) * x3)) + ((np.float32(np.int32(c4 & m15)) * x4 + np.float32(np.int32(c5 & m15)) * x5) + (np.float32(np.int32(c6 & m15)) * x6 + np.float32(np.int32(c7 & m15)) * x7))
                    hi[j] += ((np.float32(np.int32(c0 >> s4)) * x0 + np.float32(np.int32(c1 >> s4)) * x1) + (np.float32(np.int32(c2 >> s4)) * x2 + np.float32(np.int32(c3 >> s4)) * x3)) + ((np.float32(np.int32(c4 >> s4)) * x4 + np.float32(np.int32(c5 >> s4)) * x5) + (np.float32(np.int32(c6 >> s4)) * x6 + np.float32(np.int32(c7 >> s4)) * x7))
            for j in range(64):
                n = b * 64 + j
                z = (g * N + n) * 2
                a = lo[j] if j < 32 else hi[j - 32]
                y[n] += szs[z] * (a - np.float32(8.0) * sx) + szs[z + 1] * sx

def i8(q, sf, G, x, y, acc):    # the kernel kept since (quant/q4_numba.py over q4_int8.py): x rounded to int8 per group
    from waste.quant.q4_numba import q4_row_serial
    q4_row_serial(x.ctypes.data, q.ctypes.data, szs.ctypes.data, N, K, G, y)


r = ref()
for name, f in (("v0", v0), ("v1", v1), ("v2", v2), ("v3", v3), ("v4", v4), ("v5", v5), ("i8", i8)):
    y = np.zeros(N, np.float32); acc = np.zeros(64, np.float32)
    f(q, sf, G, x, y, acc)
    err = np.linalg.norm(y - r) / np.linalg.norm(r)
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(20): f(q, sf, G, x, y, acc)
        ts.append((time.perf_counter() - t) / 20)
    m = sorted(ts)[3]
    print(f"{name}: {m*1e6:.1f} us  {N*K/2/m/1e9:.1f} GB/s  err {err:.1e}")
if len(sys.argv) > 3:
    asm = list(v5.inspect_asm().values())[0]
    import collections
    c = collections.Counter(re.findall(r"\b(v\w+)\s+[^\n]*?(%[xyz]mm)", asm)) if False else None
    ops = collections.Counter()
    for line in asm.splitlines():
        m = re.match(r"\s+(v\w+)\s+.*%([xyz])mm", line)
        if m: ops[(m.group(1), m.group(2))] += 1
    print(ops.most_common(25))
