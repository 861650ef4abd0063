// GEMV straight from GGUF blocks: dequantized in registers, accumulated in fp32,
// one work-item per output row. QFMT: the format's code (quant_blocks.h: Q4_0, Q4_1, Q8_0,
// Q5_0, Q5_1, Q4_K, Q5_K, Q6_K).
//
// Device layout of a [rows, cols] matrix, nb = cols / 32 blocks per row (quant_gemv.py
// repacks the blocks; every value stays the block's own, or an exact product of its own):
//   d: float [rows][nbp]  the blocks' scales, widened from fp16 (exact), nbp = nb rounded up
//                         to 4 (zero padded); fp32 so the one-row loop broadcasts each from
//                         memory (a half needed a conversion and a lane permute: ~5% of the GEMV).
//                         K-quants: their super-blocks' d (and dmin), see quant_blocks.h
//   m: [rows][nbp]        the blocks' minimums, half (Q4_1, Q5_1); K-quants: 2 bytes a block,
//                         the block's integer scale and minimum (Q6_K: its halves' scales)
//   q: Q4: uchar [rows][nb][16]  byte j = weight j (low nibble) | weight j+16 (high nibble)
//      Q5: uchar [rows][nb][20]  the Q4 bytes, then the fifth bits (bit j: weight j), a uint
//      Q6_K: uchar [rows][nb][24] weights 0..15 whole and 16..31's low 2 bits, then their
//                         high 4 bits (quant_blocks.h)
//      Q8: char  [rows][nb][32]
// Output: row o of input row r goes to y[r * y_stride + y_offset + o] (the GEMV kernels' last
// arguments; one-row kernels take y_offset only): the matrix's own [n_rows, out_rows] (0, out_rows),
// or its rows of a stacked output (stacked_matrix.py: q, k and v in their own formats writing one
// q|k|v). Arguments, not defines: each part of a stack was a program of its own to build.
//
// Why this layout, measured on PoCL: scales apart from quants so no load straddles
// both (overlapping loads made the compiler shuffle bytes), and 4 minimums per
// vload_half4 (scalar and 2-wide half loads are emulated in software there).
//
// Weight values: Q4_0 d*(q-8), Q4_1 d*q+m, Q8_0 d*q, ... (quant_blocks.h) as
// gguf.quants.dequantize, bit for bit even where the compiler fuses d*q+m into an fma: d
// (at most 18 significant bits) times q (at most 6 bits) is exact in fp32, so the fused and
// the separately rounded results are the same.
//
// One row of x (a decode step) takes the scales out of the inner loop:
//   sum_c W[o,c] x[c] = sum_b d_b * sum_j q_bj x_bj  (+ sum_b m_b * xsum_b with minimums)
// where xsum_b is the sum of x over block b, written by the kernel that produced x
// (rms_norm, attention, silu_mul: see their sources), by block_sums below, or, in
// gemv_quant_norm (the build with -DNORM_COLS), by its own RMSNorm prologue. Per block
// that is 4 conversions, 4 multiply-adds and one scale, where dequantizing first costs
// 8 multiply-adds and a broadcast of d and m; the rounding differs from numpy's order of
// summation only as any other order does (the tests hold it to 1e-5 of float64).

// Where x lives: global memory, or the work-group's own copy, made by the kernel's prologue, in
// the builds that hold one kernel alone: gemv_quant_norm (-DNORM_COLS: the input normalized)
// and gemv_quant_silu (-DSILU_COLS: the MLP's activation).
#if defined(NORM_COLS) || defined(SILU_COLS)
#define XAS __local
#define PROLOGUE_BUILD
#else
#define XAS __global
#endif

#include "quant_blocks.h"

// the 32 weights of block b of a row (scales DROW, minimums MROW), dequantized: w0 = weights
// 0..15, w1 = weights 16..31
inline void dequant_block(__global const uchar *q, __global const float *drow, __global const half *mrow,
                          const int b, float16 *w0, float16 *w1)
{
#if QFMT == 40 || QFMT == 41 || QFMT == 80
    const float4 d4 = vload4(b >> 2, drow);
    const float d = pick4(d4, b & 3);
#if QFMT == 80
    __global const char *qc = (__global const char *)q;
    *w0 = convert_float16(vload16(2 * b, qc)) * d;
    *w1 = convert_float16(vload16(2 * b + 1, qc)) * d;
#else
    const uint16 qi = convert_uint16(vload16(b, q));
    const float16 lo = convert_float16(qi & (uint16)(0x0F));
    const float16 hi = convert_float16(qi >> (uint16)(4));
#if QFMT == 40
    *w0 = (lo - 8.0f) * d;
    *w1 = (hi - 8.0f) * d;
#else
    const float m = pick4(vload_half4(b >> 2, mrow), b & 3);
    *w0 = lo * d + m;
    *w1 = hi * d + m;
#endif
#endif
#else
#if DPER == 2
    block_terms(q, b, drow, mrow, w0, w1);  // each weight d_h (q - 32): gguf's value
#elif HAS_MINS
    block_weights(q, b, w0, w1);
    // the minimum 4-wide: a scalar half load is emulated in software on PoCL
    const float d = SCALE(drow, mrow, b), m = pick4(LOAD_MIN4(b >> 2, mrow, drow), b & 3);
    *w0 = *w0 * d + m;
    *w1 = *w1 * d + m;
#else
    block_weights(q, b, w0, w1);
    *w0 *= drow[b];
    *w1 *= drow[b];
#endif
#endif
}

#ifndef PROLOGUE_BUILD
// y[r, o] (+)= sum_c W[o, c] * x[r, c]   x: [n_rows, cols], y: [n_rows, out_rows], cols % 32 == 0;
// xsum: [n_rows, nb] block sums of x, read by formats with minimums when n_rows == 1
__kernel void gemv_quant(__global const float *d, __global const half *m, __global const uchar *q,
                         __global const float *x, __global const float *xsum, __global float *y,
                         const int cols, const int out_rows, const int n_rows, const int accumulate,
                         const int y_offset, const int y_stride)
{
    y += y_offset;
    const int o = get_global_id(0);
    if (o >= out_rows) return;
    const int nb = cols / 32, nbp = (nb + 3) & ~3;
    __global const float *drow = DROW_AT(d, o, nbp);
    __global const half *mrow = MROW_AT(m, o, nbp);
    __global const uchar *qrow = q + (size_t)o * nb * QBYTES;
    float16 w0, w1;

    if (n_rows == 1) {
        float acc;
        ROW_DOT(acc, drow, mrow, qrow, x, xsum, nb);
        y[o] = accumulate ? y[o] + acc : acc;
        return;
    }

    // several rows of x, eight (then four) at a time: each block is dequantized once per pass
    int r0 = 0;
    for (; r0 + 8 <= n_rows; r0 += 8) {
        __global const float *xr = x + (size_t)r0 * cols;
        float16 c0 = (float16)(0.0f), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
        for (int b = 0; b < nb; ++b) {
            dequant_block(qrow, drow, mrow, b, &w0, &w1);
#define ROW(c, r) c = fma(w1, vload16(2 * b + 1, xr + (r) * cols), fma(w0, vload16(2 * b, xr + (r) * cols), c))
            ROW(c0, 0); ROW(c1, 1); ROW(c2, 2); ROW(c3, 3); ROW(c4, 4); ROW(c5, 5); ROW(c6, 6); ROW(c7, 7);
#undef ROW
        }
        const float v[8] = {hsum16(c0), hsum16(c1), hsum16(c2), hsum16(c3),
                            hsum16(c4), hsum16(c5), hsum16(c6), hsum16(c7)};
        for (int r = 0; r < 8; ++r) {
            const size_t k = (size_t)(r0 + r) * y_stride + o;
            y[k] = accumulate ? y[k] + v[r] : v[r];
        }
    }
    for (; r0 < n_rows; r0 += 4) {
        // rows past n_rows re-read the last row (harmless) and are not stored
        __global const float *x0 = x + (size_t)min(r0, n_rows - 1) * cols;
        __global const float *x1 = x + (size_t)min(r0 + 1, n_rows - 1) * cols;
        __global const float *x2 = x + (size_t)min(r0 + 2, n_rows - 1) * cols;
        __global const float *x3 = x + (size_t)min(r0 + 3, n_rows - 1) * cols;
        float16 c0 = (float16)(0.0f), c1 = c0, c2 = c0, c3 = c0;
        for (int b = 0; b < nb; ++b) {
            dequant_block(qrow, drow, mrow, b, &w0, &w1);
            c0 = fma(w1, vload16(2 * b + 1, x0), fma(w0, vload16(2 * b, x0), c0));
            c1 = fma(w1, vload16(2 * b + 1, x1), fma(w0, vload16(2 * b, x1), c1));
            c2 = fma(w1, vload16(2 * b + 1, x2), fma(w0, vload16(2 * b, x2), c2));
            c3 = fma(w1, vload16(2 * b + 1, x3), fma(w0, vload16(2 * b, x3), c3));
        }
        const float v[4] = {hsum16(c0), hsum16(c1), hsum16(c2), hsum16(c3)};
        for (int r = 0; r < 4 && r0 + r < n_rows; ++r) {
            const size_t k = (size_t)(r0 + r) * y_stride + o;
            y[k] = accumulate ? y[k] + v[r] : v[r];
        }
    }
}

// rows_finish (quant_blocks.h) ends each row: its two accumulators' sum, then the minimums over the block sums

// y[r, o] (+)= sum_c W[o, c] * x[r, c] for r < n_rows[0], every row with the one-row arithmetic
// (ROW_DOT, as gemv_quant at one row, gemv_quant_norm/silu and decode_layers.cl compute it, term
// for term): a row's result never depends on how many rows run beside it (batch invariance),
// where gemv_quant's several-row passes round differently. Four rows a pass share each block's
// conversion; the last n % 4 rows go one at a time. The row count is read from the device, so a
// launch bound once serves a step of any size. xsum: [n_rows, nb], read by formats with minimums.
__kernel void gemv_quant_rows(__global const float *d, __global const half *m, __global const uchar *q,
                              __global const float *x, __global const float *xsum, __global float *y,
                              const int cols, const int out_rows, __global const int *n_rows,
                              const int accumulate, const int y_offset, const int y_stride)
{
    y += y_offset;
    const int o = get_global_id(0);
    if (o >= out_rows) return;
    const int nb = cols / 32, nbp = (nb + 3) & ~3, n = n_rows[0];
    __global const float *drow = DROW_AT(d, o, nbp);
    __global const half *mrow = MROW_AT(m, o, nbp);
    __global const uchar *qrow = q + (size_t)o * nb * QBYTES;
    float16 w0, w1;
    int r0 = 0;
    for (; r0 + 4 <= n; r0 += 4) {
        const int r1 = r0 + 1, r2 = r0 + 2, r3 = r0 + 3;
        __global const float *x0 = x + (size_t)r0 * cols, *x1 = x + (size_t)r1 * cols;
        __global const float *x2 = x + (size_t)r2 * cols, *x3 = x + (size_t)r3 * cols;
        float8 a00 = (float8)(0.0f), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
        int b = 0;
        for (; b + 2 <= nb; b += 2) {
            block_weights(qrow, b, &w0, &w1);
            BLOCK_ACC(a00, w0, w1, x0, b, drow, mrow); BLOCK_ACC(a10, w0, w1, x1, b, drow, mrow);
            BLOCK_ACC(a20, w0, w1, x2, b, drow, mrow); BLOCK_ACC(a30, w0, w1, x3, b, drow, mrow);
            block_weights(qrow, b + 1, &w0, &w1);
            BLOCK_ACC(a01, w0, w1, x0, b + 1, drow, mrow); BLOCK_ACC(a11, w0, w1, x1, b + 1, drow, mrow);
            BLOCK_ACC(a21, w0, w1, x2, b + 1, drow, mrow); BLOCK_ACC(a31, w0, w1, x3, b + 1, drow, mrow);
        }
        if (b < nb) {
            block_weights(qrow, b, &w0, &w1);
            BLOCK_ACC(a00, w0, w1, x0, b, drow, mrow); BLOCK_ACC(a10, w0, w1, x1, b, drow, mrow);
            BLOCK_ACC(a20, w0, w1, x2, b, drow, mrow); BLOCK_ACC(a30, w0, w1, x3, b, drow, mrow);
        }
        const float v[4] = {rows_finish(a00, a01, drow, mrow, xsum + (size_t)r0 * nb, nb),
                            rows_finish(a10, a11, drow, mrow, xsum + (size_t)r1 * nb, nb),
                            rows_finish(a20, a21, drow, mrow, xsum + (size_t)r2 * nb, nb),
                            rows_finish(a30, a31, drow, mrow, xsum + (size_t)r3 * nb, nb)};
        for (int r = 0; r < 4; ++r) {
            const size_t k = (size_t)(r0 + r) * y_stride + o;
            y[k] = accumulate ? y[k] + v[r] : v[r];
        }
    }
    // the last n % 4 rows one at a time, with ROW_DOT itself: a pass of four over fewer rows did
    // four rows' arithmetic (measured 3x a one-row GEMV's time for Q4_K at one row, where the
    // K-quants are bound by arithmetic, not memory: the paged step of a decode alone)
    for (; r0 < n; ++r0) {
        float acc;
        ROW_DOT(acc, drow, mrow, qrow, x + (size_t)r0 * cols, xsum + (size_t)r0 * nb, nb);
        const size_t k = (size_t)r0 * y_stride + o;
        y[k] = accumulate ? y[k] + acc : acc;
    }
}

#ifndef TILE_O
#define TILE_O 2  // output rows per work-item of gemv_quant_tiles: 1, 2 or 4
#endif
#ifndef TILE_R
#define TILE_R 4  // rows of x per pass of gemv_quant_tiles: 1, 2, 4 or 8 (then passes of 4, 2 and 1)
#endif

// gemv_quant_tiles is written out by macros, one named variable per (output, row) accumulator:
// the same loops over private arrays were not kept in registers by PoCL (measured 3x slower).
#define TILE_CAT_(A, B) A##B
#define TILE_CAT_T(A, B) TILE_CAT_(A, B)
#define TILE_CAT_R(A, B) TILE_CAT_(A, B)
#define TILE_OUTS1(M, ...) M(0, __VA_ARGS__)
#define TILE_OUTS2(M, ...) TILE_OUTS1(M, __VA_ARGS__) M(1, __VA_ARGS__)
#define TILE_OUTS4(M, ...) TILE_OUTS2(M, __VA_ARGS__) M(2, __VA_ARGS__) M(3, __VA_ARGS__)
#define TILE_ROWS1(M, ...) M(0, __VA_ARGS__)
#define TILE_ROWS2(M, ...) TILE_ROWS1(M, __VA_ARGS__) M(1, __VA_ARGS__)
#define TILE_ROWS4(M, ...) TILE_ROWS2(M, __VA_ARGS__) M(2, __VA_ARGS__) M(3, __VA_ARGS__)
#define TILE_ROWS8(M, ...) TILE_ROWS4(M, __VA_ARGS__) M(4, __VA_ARGS__) M(5, __VA_ARGS__) M(6, __VA_ARGS__) M(7, __VA_ARGS__)
#define TILE_EACH_T(M, ...) TILE_CAT_T(TILE_OUTS, TILE_O)(M, __VA_ARGS__)   // M(t, ...) for each output t
#define TILE_EACH_R(NR, M, ...) TILE_CAT_R(TILE_ROWS, NR)(M, __VA_ARGS__)  // M(r, ...) for each row r < NR

// output t's row (clamped: past out_rows it re-reads the last one and stores nothing)
#define TILE_PTRS(t, _)                                                                            \
    const int o_##t = min(o0 + t, out_rows - 1);                                                   \
    __global const float *d_##t = DROW_AT(d, o_##t, nbp);                                          \
    __global const half *m_##t = MROW_AT(m, o_##t, nbp);                                           \
    __global const uchar *q_##t = q + (size_t)o_##t * nb * QBYTES;
#define TILE_XROW(r, _) __global const float *x_##r = x + (size_t)(r0 + r) * cols;
#define TILE_ZERO(r, t) float8 a_##t##_##r##_0 = (float8)(0.0f), a_##t##_##r##_1 = (float8)(0.0f);
#define TILE_ZEROS(t, NR) TILE_EACH_R(NR, TILE_ZERO, t)
#define TILE_W(t, B) float16 w0_##t, w1_##t; block_weights(q_##t, (B), &w0_##t, &w1_##t);
#define TILE_ADD(t, r, B, H) BLOCK_ACC(a_##t##_##r##_##H, w0_##t, w1_##t, x_##r, (B), d_##t, m_##t);
#define TILE_ROW(r, B, H) TILE_EACH_T(TILE_ADD, r, B, H)
// block B of every output into accumulator H (0: even blocks, 1: odd, as ROW_DOT takes them) of
// every (output, row) pair: each output's block converted once for the NR rows, each row's x loaded
// once for the TILE_O outputs
#define TILE_BLOCK(NR, B, H)                                                                       \
    do {                                                                                           \
        TILE_EACH_T(TILE_W, B)                                                                     \
        TILE_EACH_R(NR, TILE_ROW, B, H)                                                            \
    } while (0)
#define TILE_STORE1(r, t)                                                                          \
    {                                                                                              \
        const float v_ = rows_finish(a_##t##_##r##_0, a_##t##_##r##_1, d_##t, m_##t,               \
                                     xsum + (size_t)(r0 + r) * nb, nb);                           \
        const size_t k_ = (size_t)(r0 + r) * y_stride + o0 + t;                                    \
        y[k_] = accumulate ? y[k_] + v_ : v_;                                                      \
    }
#define TILE_STORE(t, NR) if (o0 + t < out_rows) { TILE_EACH_R(NR, TILE_STORE1, t) }
// output t times row r0 of x alone, with ROW_DOT itself
#define TILE_ONE(t, _)                                                                             \
    if (o0 + t < out_rows) {                                                                       \
        float v_;                                                                                  \
        ROW_DOT(v_, d_##t, m_##t, q_##t, x + (size_t)r0 * cols, xsum + (size_t)r0 * nb, nb);       \
        const size_t k_ = (size_t)r0 * y_stride + o0 + t;                                          \
        y[k_] = accumulate ? y[k_] + v_ : v_;                                                      \
    }
// rows [r0, r0 + NR) of x times the tile's outputs, each pair exactly as ROW_DOT computes it alone
#define TILE_PASS(NR)                                                                              \
    do {                                                                                           \
        TILE_EACH_R(NR, TILE_XROW, _)                                                              \
        TILE_EACH_T(TILE_ZEROS, NR)                                                                \
        int b = 0;                                                                                 \
        for (; b + 2 <= nb; b += 2) {                                                              \
            TILE_BLOCK(NR, b, 0);                                                                  \
            TILE_BLOCK(NR, b + 1, 1);                                                              \
        }                                                                                          \
        if (b < nb) TILE_BLOCK(NR, b, 0);                                                          \
        TILE_EACH_T(TILE_STORE, NR)                                                                \
    } while (0)

// gemv_quant_rows' result, bit for bit, for any number of rows (n_rows[0]): each (output, row) pair
// is accumulated as ROW_DOT does it alone (BLOCK_ACC's expression, blocks taken in turn by two
// accumulators, then rows_finish), so neither the tile's shape nor the rows beside a row change a
// bit. A work-item computes TILE_O output rows, in passes of TILE_R rows of x (then of 4 and 2), a
// last lone row one output at a time (a tile of outputs over one row measured up to 2x the CPU time
// of one output at a time on the LM head at batch 1). Global size: out_rows / TILE_O rounded up.
#define TILE_KERNEL_BODY                                                                           \
    y += y_offset;                                                                                 \
    const int o0 = get_global_id(0) * TILE_O;                                                      \
    if (o0 >= out_rows) return;                                                                    \
    const int nb = cols / 32, nbp = (nb + 3) & ~3, n = n_rows[0];                                  \
    TILE_EACH_T(TILE_PTRS, _)                                                                      \
    int r0 = 0;                                                                                    \
    for (; r0 + TILE_R <= n; r0 += TILE_R) TILE_PASS(TILE_R);                                      \
    if (TILE_R > 4 && r0 + 4 <= n) { TILE_PASS(4); r0 += 4; }                                      \
    if (TILE_R > 2 && r0 + 2 <= n) { TILE_PASS(2); r0 += 2; }                                      \
    if (r0 < n) { TILE_EACH_T(TILE_ONE, _) }

__kernel void gemv_quant_tiles(__global const float *d, __global const half *m, __global const uchar *q,
                               __global const float *x, __global const float *xsum, __global float *y,
                               const int cols, const int out_rows, __global const int *n_rows,
                               const int accumulate, const int y_offset, const int y_stride)
{
    TILE_KERNEL_BODY
}

// The same at one output row a work-item (TILE_O 1): gemv_quant_rows' work-items, with passes of 2
// rows where gemv_quant_rows takes the rows past its passes of 4 one at a time (each block converted
// once for both: measured 12-20% less CPU at 2, 3 and 6 rows). For the steps whose x fits in L1.
#undef TILE_O
#define TILE_O 1
__kernel void gemv_quant_tiles1(__global const float *d, __global const half *m, __global const uchar *q,
                                __global const float *x, __global const float *xsum, __global float *y,
                                const int cols, const int out_rows, __global const int *n_rows,
                                const int accumulate, const int y_offset, const int y_stride)
{
    TILE_KERNEL_BODY
}

// x[r, :] = E[tokens[r], :] dequantized (the embedding lookup from the blocks), one work-item per row
__kernel void embed_rows(__global const float *d, __global const half *m, __global const uchar *q,
                         __global const int *tokens, __global float *x, const int cols)
{
    const int r = get_global_id(0);
    const int nb = cols / 32, nbp = (nb + 3) & ~3;
    const size_t row = (size_t)tokens[r];
    __global const float *drow = DROW_AT(d, row, nbp);
    __global const half *mrow = MROW_AT(m, row, nbp);
    __global const uchar *qrow = q + row * nb * QBYTES;
    __global float *out = x + (size_t)r * cols;
    float16 w0, w1;
    for (int b = 0; b < nb; ++b) {
        dequant_block(qrow, drow, mrow, b, &w0, &w1);
        vstore16(w0, 2 * b, out);
        vstore16(w1, 2 * b + 1, out);
    }
}

// xsum[r, b] = sum of x[r, 32 b : 32 b + 32]: block sums for a GEMV whose input came from
// no producer that writes them (tests, one-off launches). Work-item (r, b).
__kernel void block_sums(__global const float *x, __global float *xsum, const int cols)
{
    const int r = get_global_id(0), b = get_global_id(1), nb = cols / 32;
    __global const float *xb = x + (size_t)r * cols + 32 * b;
    const float16 s = vload16(0, xb) + vload16(1, xb);
    xsum[(size_t)r * nb + b] = hsum16(s);
}
#endif  // PROLOGUE_BUILD

#ifdef NORM_COLS
#include "norm_row.h"

// One row (a decode step of one sequence): y (+)= W * rms_norm(x, norm_w), x: [NORM_COLS].
// Every work-group first normalizes x into local memory (norm_row.h: the expression of
// norm.cl's rms_norm) and sums its blocks, so the norm needs no launch of its own: PoCL charges ~4 us a
// command, and a decode step had 61 rms_norm launches.
__kernel void gemv_quant_norm(__global const float *d, __global const half *m, __global const uchar *q,
                              __global const float *x, __global const float *norm_w, const float eps,
                              __global float *y, const int out_rows, const int accumulate,
                              const int y_offset)
{
    y += y_offset;
    __local float xn[NORM_COLS];
    __local float xsum[NORM_COLS / 32];
    if (get_local_id(0) == 0) RMS_NORM_ROW(xn, xsum, x, norm_w, eps, NORM_COLS);
    barrier(CLK_LOCAL_MEM_FENCE);
    const int o = get_global_id(0);
    if (o < out_rows) GEMV_ROW(o, d, m, q, xn, xsum, NORM_COLS, y, accumulate);
}
#endif

#ifdef SILU_COLS
#include "silu.h"

// One row (a decode step of one sequence): y (+)= W * (silu(gate) * up), gu = gate | up:
// [2 SILU_COLS]. Every work-group first makes the activation and its block sums in local memory
// with silu_mul's expression (silu.h), so the activation needs no launch of its own: on PoCL that
// launch and its gap cost ~15 us a layer, the prologue ~4 us on each core at once.
__kernel void gemv_quant_silu(__global const float *d, __global const half *m, __global const uchar *q,
                              __global const float *gu, __global float *y, const int out_rows,
                              const int accumulate, const int y_offset)
{
    y += y_offset;
    __local float act[SILU_COLS];
    __local float xsum[SILU_COLS / 32];
    if (get_local_id(0) == 0) {
        for (int b = 0; b < SILU_COLS / 32; ++b) SILU_MUL_BLOCK(xsum[b], gu, gu + SILU_COLS, b, act);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    const int o = get_global_id(0);
    if (o < out_rows) GEMV_ROW(o, d, m, q, act, xsum, SILU_COLS, y, accumulate);
}
#endif
