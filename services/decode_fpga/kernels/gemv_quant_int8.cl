// The opt-in 8-bit-activation GEMVs of the paged step (HYBRIDSERVE_DECODE_ACTIVATIONS=int8, issue
// 55 part 2): each row of x is quantized once to int8 per block of 32 (quantize_x8: one scale a
// block, its largest magnitude to 127, round to nearest even), and every output row takes integer
// dot products of its block's quants with those int8 values, then one float fma a block for the
// scales. Built with -DQFMT (quant_blocks.h's codes), every block format:
//   40 Q4_0  d (q - 8)      41 Q4_1  d q + m      80 Q8_0  d q
//   50 Q5_0  d (q - 16)     51 Q5_1  d q + m      42 Q4_K, 52 Q5_K  d q + m (d = d_super sc_b)
//   62 Q6_K  d_h (q - 32), two scales a block
// The weights are the exact path's device arrays, unchanged (quant_gemv.py's split_blocks); the
// minimums still multiply x's fp32 block sums (written by x's producer), so only the products
// q * x move, by the rounding of x (at most half a step of 1/127 of a block's largest value).
// The K-quants' kernels (gemv_int8k_rows, quantize_x8k) are in int8_super.h: x per 64 values, the
// sub-block scales in int32 lanes; gemv_int8_rows still builds for them (the per-32 A/B).
//
// The integer products of a block come from, in order of preference:
//   - AVX2 (a CPU device that PoCL builds for with AVX2): vpmaddubsw multiplies 32 unsigned bytes
//     by 32 signed ones and sums pairs to int16, vpmaddwd sums pairs of those to int32, named
//     through clang's x86 builtins (LLVM 15 made multiplies and shuffles of the same arithmetic in
//     OpenCL C vectors, slower than the fp32 kernel: bench/micro/int8_probe.cl). Signed weights
//     (Q4_0, Q5_0, Q8_0, Q6_K) go in as |w| with x's signs flipped where w < 0 (vpsignb), so nothing
//     saturates: |w| <= 128, |x| <= 127, a pair at most 32512;
//   - cl_khr_integer_dot_product's dot() on 4 signed bytes, where the device offers it (PoCL 3.1
//     here does not);
//   - a plain int16 loop elsewhere (and with -DI8_PORTABLE, which the tests build to hold the
//     paths to the same bits).
// All three give the same int32 lanes, exactly (lane j: weights 4j .. 4j + 3), so the result does
// not depend on which one a device takes, and the float arithmetic after them is one expression.
//
// Batch invariance: every (output, row) pair is accumulated the same way whatever the rows beside
// it: blocks in order, even blocks into one 8-lane accumulator and odd into another, each as
// fma(float(int lanes), scale * dx, acc), then the two added and folded, then the minimums as the
// exact kernels add them. A pass of 4 rows shares each block's unpacking; the rest go one by one.

#define XAS __global
#include "quant_blocks.h"

#if QFMT == 40 || QFMT == 50 || QFMT == 80 || QFMT == 62
#define W_SIGNED 1  // weights below zero: the AVX2 path flips x's signs
#else
#define W_SIGNED 0
#endif

#if defined(__AVX2__) && !defined(I8_PORTABLE)
typedef char c32 __attribute__((ext_vector_type(32)));
typedef short s16v __attribute__((ext_vector_type(16)));
typedef int i8v __attribute__((ext_vector_type(8)));
#endif

// block b's 32 quants as bytes before their offsets (0..63; Q8_0 its signed values): w0 = weights
// 0..15, w1 = 16..31
inline void i8_quants(__global const uchar *q, const int b, char16 *w0, char16 *w1)
{
#if QFMT == 80
    *w0 = vload16(2 * b, (__global const char *)q);
    *w1 = vload16(2 * b + 1, (__global const char *)q);
#elif QFMT == 62
    // quant_blocks.h's Q6_K bytes: byte j = weight j (6 bits) | weight 16 + j's low 2 bits << 6; then
    // weight 16 + j's high 4 bits at bit 4 (j >> 1) of uint (j & 1). The high bits come into place in
    // 32-bit lanes as block_weights_f does it (one variable shift a lane), then pack to bytes: picking
    // the 16 nibbles byte by byte measured twice the fp32 kernel's time
    __global const uchar *qb = q + 24 * b;
    const uchar16 lo = vload16(0, qb);
    const uint2 h2 = vload2(0, (__global const uint *)(qb + 16));
    const uint2 u2 = h2 << (uint2)(2);
    const uint16 h = (uint16)(u2, u2, u2, u2, h2, h2, h2, h2);
    const uint16 sh = (uint16)(0, 0, 4, 4, 8, 8, 12, 12, 14, 14, 18, 18, 22, 22, 26, 26);
    const uint16 hi = (convert_uint16(lo) >> (uint16)(6)) | ((h >> sh) & (uint16)(0x3C));
    *w0 = as_char16(lo & (uchar16)(0x3F));
    *w1 = as_char16(convert_uchar16(hi));
#elif QFMT == 50 || QFMT == 51 || QFMT == 52
    // the Q4 bytes, then the fifth bits as a little-endian uint (bit j: weight j): each lane's bit
    // picked by a mask and a compare (a byte lane cannot shift by its own count on AVX2)
    __global const uchar *qb = q + 20 * b;
    const uchar16 lo = vload16(0, qb);
    const uchar4 hb = vload4(0, qb + 16);
    const uchar16 bit = (uchar16)(1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128);
    const uchar16 h0 = (uchar16)(hb.s0, hb.s0, hb.s0, hb.s0, hb.s0, hb.s0, hb.s0, hb.s0,
                                 hb.s1, hb.s1, hb.s1, hb.s1, hb.s1, hb.s1, hb.s1, hb.s1);
    const uchar16 h1 = (uchar16)(hb.s2, hb.s2, hb.s2, hb.s2, hb.s2, hb.s2, hb.s2, hb.s2,
                                 hb.s3, hb.s3, hb.s3, hb.s3, hb.s3, hb.s3, hb.s3, hb.s3);
    *w0 = as_char16((lo & (uchar16)(0x0F)) | (as_uchar16((h0 & bit) == bit) & (uchar16)(0x10)));
    *w1 = as_char16((lo >> (uchar16)(4)) | (as_uchar16((h1 & bit) == bit) & (uchar16)(0x10)));
#else  // 40, 41, 42: 16 bytes, byte j = weight j | weight j + 16 << 4
    const uchar16 qb = vload16(b, q);
    *w0 = as_char16(qb & (uchar16)(0x0F));
    *w1 = as_char16(qb >> (uchar16)(4));
#endif
}

// block b's 32 quants as signed bytes, their offsets subtracted (Q4_0 8, Q5_0 16, Q6_K 32)
inline void i8_weights(__global const uchar *q, const int b, char16 *w0, char16 *w1)
{
    i8_quants(q, b, w0, w1);
#if QFMT == 40 || QFMT == 50 || QFMT == 62
    const char16 off = (char16)(QFMT == 40 ? 8 : QFMT == 50 ? 16 : 32);
    *w0 -= off;
    *w1 -= off;
#endif
}

// sum_j w_j xq_j over block b as 8 int lanes, lane k = weights 4k .. 4k + 3 (xb: the block's int8 x)
inline int8 i8_dot(const char16 w0, const char16 w1, __global const char *xb)
{
#if defined(__AVX2__) && !defined(I8_PORTABLE)
    c32 w;
    w.s0123456789abcdef = w0;
    w.hi = w1;
    c32 x = *(__global const c32 *)xb;  // 32-byte aligned: blocks of 32 in rows of whole blocks
#if W_SIGNED
    x = __builtin_ia32_psignb256(x, w);  // x's sign flipped where w < 0 (zeroed where w == 0)
    w = __builtin_ia32_psignb256(w, w);  // |w| (-128 stays 0x80: 128 unsigned)
#endif
    return as_int8(__builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256(w, x), (s16v)(1)));
#elif defined(__opencl_c_integer_dot_product_input_4x8bit) || defined(cl_khr_integer_dot_product)
    const char16 x0 = vload16(0, xb), x1 = vload16(1, xb);
    return (int8)(dot(w0.s0123, x0.s0123), dot(w0.s4567, x0.s4567), dot(w0.s89ab, x0.s89ab),
                  dot(w0.scdef, x0.scdef), dot(w1.s0123, x1.s0123), dot(w1.s4567, x1.s4567),
                  dot(w1.s89ab, x1.s89ab), dot(w1.scdef, x1.scdef));
#else
    const int16 p0 = convert_int16(convert_short16(w0) * convert_short16(vload16(0, xb)));
    const int16 p1 = convert_int16(convert_short16(w1) * convert_short16(vload16(1, xb)));
    const int8 s0 = p0.even + p0.odd, s1 = p1.even + p1.odd;
    return (int8)(s0.even + s0.odd, s1.even + s1.odd);
#endif
}

// block b's weight scale(s) as 8 lanes matching i8_dot's: Q6_K's first half (weights 0..15) in
// lanes 0..3, its second in 4..7; one scale a block elsewhere (each an exact product, quant_blocks.h)
inline float8 i8_scales(__global const float *drow, __global const half *mrow, const int b)
{
#if QFMT == 62
    const float s0 = HALF_SCALE(drow, mrow, b, 0), s1 = HALF_SCALE(drow, mrow, b, 1);
    return (float8)(s0, s0, s0, s0, s1, s1, s1, s1);
#else
    return (float8)(SCALE(drow, mrow, b));
#endif
}

// A (+)= block B's products with row X of int8 x (DX: its block scales), W0/W1/S8 the block's
#define I8_ACC(A, W0, W1, S8, XQ, DX, B) \
    A = fma(convert_float8(i8_dot((W0), (W1), (XQ) + 32 * (B))), (S8) * (DX)[B], A)

// a pair's ending: rows_finish (quant_blocks.h), in the exact kernels' order

#define I8_STORE(R, V)                                                     \
    {                                                                      \
        const size_t k_ = (size_t)(R) * y_stride + o;                      \
        y[k_] = accumulate ? y[k_] + (V) : (V);                            \
    }

// y[r, o] (+)= sum_c W[o, c] x[r, c] for r < n_rows[0], x given as xq [n, cols] int8 and dx [n, nb]
// (quantize_x8's) and xsum [n, nb] (x's fp32 block sums; read by formats with minimums). One output
// row a work-item.
__kernel void gemv_int8_rows(__global const float *d, __global const half *m, __global const uchar *q,
                             __global const char *xq, __global const float *dx, __global const float *xsum,
                             __global float *y, const int cols, const int out_rows, __global const int *n_rows,
                             const int accumulate, const int y_offset, const int y_stride)
{
    y += y_offset;
    const int o = get_global_id(0);
    if (o >= out_rows) return;
    const int nb = cols / 32, nbp = (nb + 3) & ~3, n = n_rows[0];
    __global const float *drow = DROW_AT(d, o, nbp);
    __global const half *mrow = MROW_AT(m, o, nbp);
    __global const uchar *qrow = q + (size_t)o * nb * QBYTES;
    char16 w0, w1;
    int r0 = 0;
    for (; r0 + 4 <= n; r0 += 4) {  // four rows a pass, each block unpacked once for them
        __global const char *x0 = xq + (size_t)r0 * cols, *x1 = x0 + cols, *x2 = x1 + cols, *x3 = x2 + cols;
        __global const float *d0 = dx + (size_t)r0 * nb, *d1 = d0 + nb, *d2 = d1 + nb, *d3 = d2 + nb;
        float8 a00 = (float8)(0.0f), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
        int b = 0;
        for (; b + 2 <= nb; b += 2) {
            i8_weights(qrow, b, &w0, &w1);
            float8 s8 = i8_scales(drow, mrow, b);
            I8_ACC(a00, w0, w1, s8, x0, d0, b); I8_ACC(a10, w0, w1, s8, x1, d1, b);
            I8_ACC(a20, w0, w1, s8, x2, d2, b); I8_ACC(a30, w0, w1, s8, x3, d3, b);
            i8_weights(qrow, b + 1, &w0, &w1);
            s8 = i8_scales(drow, mrow, b + 1);
            I8_ACC(a01, w0, w1, s8, x0, d0, b + 1); I8_ACC(a11, w0, w1, s8, x1, d1, b + 1);
            I8_ACC(a21, w0, w1, s8, x2, d2, b + 1); I8_ACC(a31, w0, w1, s8, x3, d3, b + 1);
        }
        if (b < nb) {
            i8_weights(qrow, b, &w0, &w1);
            const float8 s8 = i8_scales(drow, mrow, b);
            I8_ACC(a00, w0, w1, s8, x0, d0, b); I8_ACC(a10, w0, w1, s8, x1, d1, b);
            I8_ACC(a20, w0, w1, s8, x2, d2, b); I8_ACC(a30, w0, w1, s8, x3, d3, b);
        }
        __global const float *xs = xsum + (size_t)r0 * nb;
        I8_STORE(r0, rows_finish(a00, a01, drow, mrow, xs, nb));
        I8_STORE(r0 + 1, rows_finish(a10, a11, drow, mrow, xs + nb, nb));
        I8_STORE(r0 + 2, rows_finish(a20, a21, drow, mrow, xs + 2 * nb, nb));
        I8_STORE(r0 + 3, rows_finish(a30, a31, drow, mrow, xs + 3 * nb, nb));
    }
    for (; r0 < n; ++r0) {  // the last n % 4 rows alone, the same expression
        __global const char *x0 = xq + (size_t)r0 * cols;
        __global const float *d0 = dx + (size_t)r0 * nb;
        float8 a0 = (float8)(0.0f), a1 = a0;
        int b = 0;
        for (; b + 2 <= nb; b += 2) {
            i8_weights(qrow, b, &w0, &w1);
            I8_ACC(a0, w0, w1, i8_scales(drow, mrow, b), x0, d0, b);
            i8_weights(qrow, b + 1, &w0, &w1);
            I8_ACC(a1, w0, w1, i8_scales(drow, mrow, b + 1), x0, d0, b + 1);
        }
        if (b < nb) {
            i8_weights(qrow, b, &w0, &w1);
            I8_ACC(a0, w0, w1, i8_scales(drow, mrow, b), x0, d0, b);
        }
        I8_STORE(r0, rows_finish(a0, a1, drow, mrow, xsum + (size_t)r0 * nb, nb));
    }
}

// xq[r, 32 b + j] = x[r, 32 b + j] / dx[r, b] rounded to nearest even, dx[r, b] = (the block's largest
// |x|) / 127 (0 for a block of zeros, whose xq are then 0). Work-item (r, b), global offset on r.
__kernel void quantize_x8(__global const float *x, __global char *xq, __global float *dx, const int cols)
{
    const int r = get_global_id(0), b = get_global_id(1), nb = cols / 32;
    __global const float *xb = x + (size_t)r * cols + 32 * b;
    const float16 v0 = vload16(0, xb), v1 = vload16(1, xb);
    const float16 a = fmax(fabs(v0), fabs(v1));
    const float8 a8 = fmax(a.lo, a.hi);
    const float4 a4 = fmax(a8.lo, a8.hi);
    const float amax = fmax(fmax(a4.x, a4.y), fmax(a4.z, a4.w));
    const float dv = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __global char *qb = xq + (size_t)r * cols + 32 * b;
    vstore16(convert_char16_sat_rte(v0 * inv), 0, qb);
    vstore16(convert_char16_sat_rte(v1 * inv), 1, qb);
    dx[(size_t)r * nb + b] = dv;
}

#if KQ  // the K-quants on x quantized per 64-256 (quantize_x8k, gemv_int8k_rows)
#include "int8_super.h"
#endif
