"""The PTX ISA's fragments of mma.sync.aligned.m16n8k32 with 8-bit operands (.e4m3 among them;
"Matrix Fragments for mma.m16n8k32"), in numpy: which lane holds which element of A (16 x 32, row),
B (32 x 8, col) and C/D (16 x 8). gemv.cu's gemv8_mma feeds the mma from 16-byte loads in a
k-permuted order; tests/test_fp8.py checks with these that the order gives the true dot products.
No GPU needed."""

from __future__ import annotations

import numpy as np

WARP = 32


def a_element(lane: int, i: int) -> tuple[int, int]:
    """(row, k) of element a_i (0..15; 4 to a register, the lowest byte first) in `lane`."""
    group, tig = lane >> 2, lane % 4
    row = group if (i < 4 or 8 <= i < 12) else group + 8
    k = tig * 4 + (i & 3) + (16 if i >= 8 else 0)
    return row, k


def b_element(lane: int, i: int) -> tuple[int, int]:
    """(k, column) of element b_i (0..7) in `lane`."""
    group, tig = lane >> 2, lane % 4
    return tig * 4 + (i & 3) + (16 if i >= 4 else 0), group


def d_element(lane: int, i: int) -> tuple[int, int]:
    """(row, column) of accumulator c_i / d_i (0..3) in `lane`."""
    group, tig = lane >> 2, lane % 4
    return group + (8 if i >= 2 else 0), tig * 2 + (i & 1)


def mma(a_regs: np.ndarray, b_regs: np.ndarray) -> np.ndarray:
    """What the warp's mma computes from its lanes' registers: a_regs [32, 16] (a_0..a_15 of each
    lane), b_regs [32, 8]; returns d [32, 4] (each lane's accumulators, from zero), exactly (int64)."""
    A = np.zeros((16, 32), dtype=np.int64)
    B = np.zeros((32, 8), dtype=np.int64)
    for lane in range(WARP):
        for i in range(16):
            A[a_element(lane, i)] = a_regs[lane, i]
        for i in range(8):
            B[b_element(lane, i)] = b_regs[lane, i]
    D = A @ B
    return np.array([[D[d_element(lane, i)] for i in range(4)] for lane in range(WARP)])


def gemv8_block(W: np.ndarray, X: np.ndarray) -> np.ndarray:
    """gemv8_mma's two mmas of one 64-k block, written as the kernel loads its registers: W [16, 64]
    (the unit's mma rows: g < 8 a pair's first rows, g + 8 its second), X [8, 64] (input rows, the
    unused ones zero). Lane (g, t) loads bytes 16t..16t+15 of rows g and g+8 of W ("lo", "hi") and
    of row g of X; of each load, words 0-1 feed the first mma and words 2-3 the second, as A
    registers (lo, hi, lo, hi) and B registers. Returns each lane's accumulators [32, 4]."""
    d = np.zeros((WARP, 4), dtype=np.int64)
    for c in range(2):  # the block's two mmas
        a_regs = np.zeros((WARP, 16), dtype=np.int64)
        b_regs = np.zeros((WARP, 8), dtype=np.int64)
        for lane in range(WARP):
            g, t = lane >> 2, lane % 4
            lo, hi, x = W[g, 16 * t:16 * t + 16], W[g + 8, 16 * t:16 * t + 16], X[g, 16 * t:16 * t + 16]
            word = lambda v, j: v[4 * j:4 * j + 4]  # noqa: E731 (the j-th 32-bit word's 4 bytes)
            a_regs[lane] = np.concatenate([word(lo, 2 * c), word(hi, 2 * c), word(lo, 2 * c + 1), word(hi, 2 * c + 1)])
            b_regs[lane] = np.concatenate([word(x, 2 * c), word(x, 2 * c + 1)])
        d += mma(a_regs, b_regs)
    return d


# --- mma.m16n8k16 with fp16 operands (sm_90's gemv8_mma: GEMV8_HALVES) ---------------------------
def a16_element(lane: int, i: int) -> tuple[int, int]:
    """(row, k) of element a_i (0..7; 2 to a register, the low half first) of m16n8k16 fp16."""
    group, tig = lane >> 2, lane % 4
    row = group + (8 if i in (2, 3, 6, 7) else 0)
    return row, tig * 2 + (i & 1) + (8 if i >= 4 else 0)


def b16_element(lane: int, i: int) -> tuple[int, int]:
    """(k, column) of element b_i (0..3) of m16n8k16 fp16."""
    group, tig = lane >> 2, lane % 4
    return tig * 2 + (i & 1) + (8 if i >= 2 else 0), group


def mma16(a_regs: np.ndarray, b_regs: np.ndarray) -> np.ndarray:
    """m16n8k16 from the lanes' registers: a_regs [32, 8], b_regs [32, 4]; d [32, 4] (C/D as k32's)."""
    A = np.zeros((16, 16), dtype=np.int64)
    B = np.zeros((16, 8), dtype=np.int64)
    for lane in range(WARP):
        for i in range(8):
            A[a16_element(lane, i)] = a_regs[lane, i]
        for i in range(4):
            B[b16_element(lane, i)] = b_regs[lane, i]
    D = A @ B
    return np.array([[D[d_element(lane, i)] for i in range(4)] for lane in range(WARP)])


def gemv8_block_halves(W: np.ndarray, X: np.ndarray) -> np.ndarray:
    """gemv8_mma's four m16n8k16 of one 64-k block with fp16 operands, as the kernel loads them:
    lane (g, t) loads bytes 16t..16t+15 of weight rows g and g+8 (as before) and the 16 fp16 of
    input row g at the same k (32 bytes); mma c takes word c of each weight load, converted to two
    fp16 pairs (its low two bytes, then its high two), as A registers (lo low, hi low, lo high, hi
    high), and fp16 words 2c and 2c+1 of the input as B registers."""
    d = np.zeros((WARP, 4), dtype=np.int64)
    for c in range(4):
        a_regs = np.zeros((WARP, 8), dtype=np.int64)
        b_regs = np.zeros((WARP, 4), dtype=np.int64)
        for lane in range(WARP):
            g, t = lane >> 2, lane % 4
            lo, hi, x = W[g, 16 * t:16 * t + 16], W[g + 8, 16 * t:16 * t + 16], X[g, 16 * t:16 * t + 16]
            word = lo[4 * c:4 * c + 4], hi[4 * c:4 * c + 4]
            a_regs[lane] = np.concatenate([word[0][:2], word[1][:2], word[0][2:], word[1][2:]])
            b_regs[lane] = x[4 * c:4 * c + 4]  # fp16 words 2c and 2c+1: elements 4c .. 4c+3
        d += mma16(a_regs, b_regs)
    return d
