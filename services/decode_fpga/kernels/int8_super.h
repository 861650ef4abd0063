// The K-quants' int8 GEMV on x quantized per K_XB values (64 by default: int8_gemv.K_X_BLOCK; 128 or
// 256, a super-block as llama.cpp's Q8_K), included by gemv_quant_int8.cl for QFMT 42 (Q4_K), 52
// (Q5_K) and 62 (Q6_K) after its block helpers.
//
// Why: with x quantized per block of 32 (gemv_int8_rows) every block's integer sum becomes a float
// and meets two fp32 scales (the weights' d_super sc_b and x's), as many float instructions a block
// as the fp32 kernel's. A K-quant's sub-block scales are small integers under one fp16 d_super, so
// with one x scale over several blocks they can multiply the integer sums in int32 lanes:
//   sum_j w_j x_j = d_super dx sum_b sc_b sum_{j in b} q_j xq_j        (- the minimums, below)
// per pair of blocks only the quants' unpacking, vpmaddubsw (q times xq, pairs to int16) and vpmaddwd
// against the sub-blocks' scales (pairs to int32, times sc) added into 8 int32 lanes; per chunk of x
// and row one int -> float conversion and one fma by dx, per super-block one fma by d_super into one
// 8-lane accumulator a row, whose lanes are summed at the end (hsum8). Larger chunks cost more divergence (the few large values
// of SiLU(gate) * up set a chunk's scale) and save little more time: docs/decode-kernels.md.
//
// Blocks go in pairs, 64 weights in two 32-byte registers: W0 = the first 16 quants of both blocks,
// W1 = their last 16. x is stored to match (quantize_x8k): each 64 values as their groups of 16 in
// the order 0, 2, 1, 3, so X0 = x's 16-groups 0 and 2 and X1 = 1 and 3, and a Q4_K pair's 32 quant
// bytes give W0 and W1 with a mask and a shift (no 128-bit insert a block). Each register's halves
// belong to one block (or Q6_K half), so a pair's scales are one shuffle of the super-block's bytes.
//   - Q4_K, Q5_K: the minimums (-dmin_super mn_b, as the exact kernels) multiply x's fp32 block sums
//     (x_sums, written by x's producer), 8 in one fma a super-block: exact x, and no integer sums
//     needed (rows_finish's loop after the row instead: 857 against 695 us of CPU for a 2048x8192
//     Q4_K GEMV at one row, 4855 against 3505 at eight).
//   - Q6_K: q - 32 with q in 0..63 unsigned into vpmaddubsw (no sign flips), and 32 sum sc_h xsum_h
//     taken off once a chunk from x's int16 sums of 16 (bsum, written by quantize_x8k): integer, so
//     exactly the signed products' sum.
// Bounds: Q6_K's int16 pairs <= 2 * 63 * 127, int32 lanes <= 8 * 2 * 2 * 63 * 127 * 128 < 2^31.
// The int32 lanes are exact whichever instructions make them (AVX2 builtins, or the int loop with
// -DI8_PORTABLE), so the bits after them are one float expression on every device; every (output,
// row) pair takes its chunks in order through it whatever the rows beside it (batch invariance).

#ifndef K_XB
#define K_XB 64  // x's values a scale: 64, 128 or 256 (int8_gemv.py passes int8_gemv.K_X_BLOCK)
#endif
#define K_XPAIRS (K_XB / 64)  // block pairs an x scale
#define K_XN (K_XB / 16)      // Q6_K halves an x scale

// x's scales (largest |x| / 127 of each K_XB values), int8 x (round to nearest even; each 64 values
// stored as their 16-groups 0, 2, 1, 3) and int16 sums of each 16 (in x's order): xq [n, cols], dx
// [n, cols / K_XB], bsum [n, cols / 16]. Work-item (r, s): super-block s of row r, global offset on r.
__kernel void quantize_x8k(__global const float *x, __global char *xq, __global float *dx, __global short *bsum,
                           const int cols)
{
    const int r = get_global_id(0), s = get_global_id(1);
    __global const float *xs = x + (size_t)r * cols + 256 * s;
    __global char *qs = xq + (size_t)r * cols + 256 * s;
    __global short *bs = bsum + (size_t)r * (cols / 16) + 16 * s;
    for (int k = 0; k < 256 / K_XB; ++k) {
        float16 a = (float16)(0.0f);
        for (int i = k * K_XN; i < (k + 1) * K_XN; ++i) a = fmax(a, fabs(vload16(i, xs)));
        const float8 a8 = fmax(a.lo, a.hi);
        const float4 a4 = fmax(a8.lo, a8.hi);
        const float amax = fmax(fmax(a4.x, a4.y), fmax(a4.z, a4.w));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = k * K_XN; i < (k + 1) * K_XN; ++i) {
            const char16 c = convert_char16_sat_rte(vload16(i, xs) * inv);
            vstore16(c, (i & ~3) | ((i & 1) << 1) | ((i >> 1) & 1), qs);  // 16-groups 1 and 2 of each 4 swapped
            const short16 w = convert_short16(c);
            const short8 s8 = w.lo + w.hi;
            const short4 s4 = s8.lo + s8.hi;
            bs[i] = (s4.x + s4.y) + (s4.z + s4.w);
        }
        dx[(size_t)r * (cols / K_XB) + s * (256 / K_XB) + k] = amax / 127.0f;
    }
}

#if defined(__AVX2__) && !defined(I8_PORTABLE)
typedef uchar uc32 __attribute__((ext_vector_type(32)));
typedef ulong ul4 __attribute__((ext_vector_type(4)));
#define as_uc32(V) __builtin_astype((V), uc32)  // bit casts of the builtins' vector types
#define as_c32(V) __builtin_astype((V), c32)
#define as_s16v(V) __builtin_astype((V), s16v)

#define LD16(P, OFF) vload16(0, (__global const char *)(P) + (OFF))  // 16 bytes at P + OFF

inline c32 c32_of(const char16 a, const char16 b)
{
    c32 v;
    v.s0123456789abcdef = a;
    v.hi = b;
    return v;
}

// pair P's quants (blocks 2P, 2P + 1 of the row): W0 = [block 2P's 0..15 | 2P + 1's 0..15], W1 = their
// 16..31, unsigned (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63)
inline void k_pair(__global const uchar *qrow, const int p, c32 *w0, c32 *w1)
{
#if QFMT == 42  // 32 bytes: byte j of a block = quant j | quant j + 16 << 4
    const uc32 v = as_uc32(c32_of(LD16(qrow, 32 * p), LD16(qrow, 32 * p + 16)));
    *w0 = as_c32(v & (uc32)(0x0F));
    *w1 = as_c32(v >> (uc32)(4));
#elif QFMT == 52  // 16 nibble bytes as Q4_K's, then the fifth bits as a uint (bit j: quant j)
    __global const uchar *qb = qrow + 40 * p;
    const uc32 v = as_uc32(c32_of(LD16(qb, 0), LD16(qb, 20)));
    const uint h0 = *(__global const uint *)(qb + 16), h1 = *(__global const uint *)(qb + 36);
    const c32 h = as_c32((i8v)(h0, h0, h0, h0, h1, h1, h1, h1));
    // quant j's fifth bit: byte j >> 3 of its uint at lane j, kept where bit j & 7 is set
    const c32 pick0 = (c32)(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const uc32 bit = (uc32)(1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                            1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128);
    const uc32 b0 = as_uc32(__builtin_ia32_pshufb256(h, pick0)) & bit;
    const uc32 b1 = as_uc32(__builtin_ia32_pshufb256(h, pick0 + (c32)(2))) & bit;
    *w0 = as_c32((v & (uc32)(0x0F)) | (as_uc32(b0 == bit) & (uc32)(0x10)));
    *w1 = as_c32((v >> (uc32)(4)) | (as_uc32(b1 == bit) & (uc32)(0x10)));
#else  // 62: 16 bytes (byte j: quant j | quant 16 + j's low 2 bits << 6), then 8 bytes: quant 16 + j's
       // high 4 bits at bit 4 (j >> 1) of uint (j & 1)
    __global const uchar *qb = qrow + 48 * p;
    const uc32 lo = as_uc32(c32_of(LD16(qb, 0), LD16(qb, 24)));
    const ulong e = *(__global const ulong *)(qb + 16), f = *(__global const ulong *)(qb + 40);
    // each half: its 8 bytes, then the same shifted down a nibble; lane j picks the byte holding j's
    // nibble: 8 ((j >> 1) & 1) + 4 (j & 1) + (j >> 2)
    const c32 nib = as_c32((ul4)(e, e, f, f) >> (ul4)(0, 4, 0, 4));  // one vpsrlvq (not 4 scalar moves)
    const c32 pick = (c32)(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                           0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const uc32 hi = as_uc32(__builtin_ia32_pshufb256(nib, pick)) & (uc32)(0x0F);
    *w0 = as_c32(lo & (uc32)(0x3F));
    *w1 = as_c32((lo >> (uc32)(6)) | (hi << (uc32)(2)));
#endif
}

// int16 lanes of pair P's scales from the super-block's 16 scale bytes KB, both 128-bit halves holding
// them (Q4_K, Q5_K: sc_b, mn_b a block; Q6_K: sc_h of its halves): S0 for W0, S1 for W1
#if QFMT == 62
// Q6_K's are signed: widened to int16 first, blocks 0..3's in one register's halves, 4..7's in another
#define K_PAIR_SCALES(SW, P, S0, S1)                                                             \
    do {                                                                                     \
        const c32 w_ = as_c32((SW)[(P) >> 1]);                                               \
        const c32 k_ = (c32)(8 * ((P) & 1));                                                 \
        S0 = as_s16v(__builtin_ia32_pshufb256(w_, (c32)(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,  \
                                                         4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5) + k_)); \
        S1 = as_s16v(__builtin_ia32_pshufb256(w_, (c32)(2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,  \
                                                         6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7) + k_)); \
    } while (0)
#else
// byte 4P (block 2P's sc) to the low byte of every int16 lane of the low half, 4P + 2 (block 2P + 1's)
// to the high half's; the high bytes zeroed (a shuffle index with bit 7 set, which adding 4P keeps)
#define K_PAIR_SCALES(SW, P, S0, S1)                                                             \
    do {                                                                                     \
        const c32 k_ = (c32)(0, -128, 0, -128, 0, -128, 0, -128, 0, -128, 0, -128, 0, -128, 0, -128,  \
                             2, -128, 2, -128, 2, -128, 2, -128, 2, -128, 2, -128, 2, -128, 2, -128); \
        S0 = as_s16v(__builtin_ia32_pshufb256((SW)[0], k_ + (c32)(4 * (P))));              \
        S1 = S0;                                                                             \
    } while (0)
#endif

// the super-block's scale registers for K_PAIR_SCALES
#if QFMT == 62
#define K_SUPER_SCALES(KB, SW)                                                                   \
    s16v SW[2];                                                                              \
    {                                                                                        \
        const short16 w_ = convert_short16(as_char16(KB));                                   \
        SW[0] = (s16v)(w_.lo, w_.lo);                                                        \
        SW[1] = (s16v)(w_.hi, w_.hi);                                                        \
    }
#else
#define K_SUPER_SCALES(KB, SW) c32 SW[1] = {c32_of(as_char16(KB), as_char16(KB))};
#endif

// 8 int32 lanes += pair P's products with the int8 x at XP (the pair's 64 values), times their scales
#if QFMT == 62
#define K_PAIR_ACC(I, W0, W1, S0, S1, XP)                                                        \
    I += as_int8(__builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256((W0), *(__global const c32 *)(XP)), (S0)) + \
                 __builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256((W1), *(__global const c32 *)((XP) + 32)), (S1)))
#else
// Q4_K, Q5_K: both halves' int16 pairs share their blocks' scales (S0 == S1), so they add as int16
// (each |pair| <= 2 * 31 * 127, the sum < 2^15) and take one vpmaddwd: 4 instructions a pair and row,
// not 6, the same int32 lanes
#define K_PAIR_ACC(I, W0, W1, S0, S1, XP)                                                        \
    I += as_int8(__builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256((W0), *(__global const c32 *)(XP)) + \
                                           __builtin_ia32_pmaddubsw256((W1), *(__global const c32 *)((XP) + 32)), (S0)))
#endif

#else  // the portable int loop (and cl_khr_integer_dot_product's dot()): the same int32 lanes

// sum_{j = 4k}^{4k + 3} w_j x_j for k < 4
inline int4 k_hdot(const char16 w, __global const char *x)
{
    const char16 v = vload16(0, x);
#if !defined(I8_PORTABLE) && \
    (defined(__opencl_c_integer_dot_product_input_4x8bit) || defined(cl_khr_integer_dot_product))
    return (int4)(dot(w.s0123, v.s0123), dot(w.s4567, v.s4567), dot(w.s89ab, v.s89ab), dot(w.scdef, v.scdef));
#else
    const int16 p = convert_int16(convert_short16(w) * convert_short16(v));
    const int8 s = p.even + p.odd;
    return s.even + s.odd;
#endif
}

// pair P's lanes: 0..3 block 2P's, 4..7 block 2P + 1's; lane k of a block = its first half's scale times
// quants 4k..4k+3 with x, plus its second half's times quants 16 + 4k..
inline int8 k_pair_dot(__global const uchar *qrow, const int p, const uchar16 kb, __global const char *xp)
{
    char16 a0, a1, b0, b1;
    i8_quants(qrow, 2 * p, &a0, &a1);
    i8_quants(qrow, 2 * p + 1, &b0, &b1);
    const int j = 4 * (p & 3);  // the pair's first scale byte in the super-block's 16
#if QFMT == 62
    const int sa0 = as_char(kb[j]), sa1 = as_char(kb[j + 1]), sb0 = as_char(kb[j + 2]), sb1 = as_char(kb[j + 3]);
#else
    const int sa0 = kb[j], sa1 = sa0, sb0 = kb[j + 2], sb1 = sb0;
#endif
    return (int8)(k_hdot(a0, xp) * sa0 + k_hdot(a1, xp + 32) * sa1,
                  k_hdot(b0, xp + 16) * sb0 + k_hdot(b1, xp + 48) * sb1);
}
#endif

// Q6_K: 32 sum_h sc_h bsum_h over the halves h of x-chunk C of a super-block (SC: the super-block's 16
// scales, B: x's sums of its 16 halves; the other halves' scales masked to 0) as 8 int32 lanes (lane k:
// halves 2k, 2k + 1)
inline int8 k_offsets(const short16 sc, const short16 b, const int c)
{
    const short16 h = (short16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const short16 m = sc & ((h >= (short16)(c * K_XN)) & (h < (short16)((c + 1) * K_XN)));
#if defined(__AVX2__) && !defined(I8_PORTABLE)
    return as_int8(__builtin_ia32_pmaddwd256(m, b)) << 5;
#else
    return (convert_int8(m.even) * convert_int8(b.even) + convert_int8(m.odd) * convert_int8(b.odd)) << 5;
#endif
}

#define K_DS(DROW, S) (DROW)[QFMT == 62 ? (S) : 2 * (S)]  // d_super of super-block S
// super-block S's minimums: -dmin_super times the bytes mn_b (odd bytes of KB)
#define K_MINS(KB, S) ((float8)(-drow[2 * (S) + 1]) * convert_float8((KB).odd))

// the end of x-chunk C of a super-block for one row: T += its int lanes I (less Q6_K's offsets, from
// the row's half sums B) times x's scale DX; I back to 0. d_super multiplies T once a super-block
// (K_SUPER_END): a chunk of 64 then costs a conversion, a broadcast load and an fma a row
#if QFMT == 62
#define K_END1(T, I, B, DX, C)                                                                   \
    {                                                                                        \
        I -= k_offsets(sc16, (B), (C));                                                      \
        T = fma(convert_float8(I), (float8)(DX), T);                                         \
        I = (int8)(0);                                                                       \
    }
#else
#define K_END1(T, I, B, DX, C)                                                                   \
    {                                                                                        \
        T = fma(convert_float8(I), (float8)(DX), T);                                         \
        I = (int8)(0);                                                                       \
    }
#endif
// a super-block's end for one row: F += T d_super, then (Q4_K, Q5_K) its minimums MN times x's fp32
// block sums at XS
#if HAS_MINS
#define K_SUPER_END(F, T, MN, XS) F = fma((MN), vload8(s, (XS)), fma((T), (float8)(ds), (F)))
#else
#define K_SUPER_END(F, T, MN, XS) F = fma((T), (float8)(ds), (F))
#endif

// super-block S's pairs into each row's int lanes (K_ROWS_ACC), every K_XPAIRS pairs an x-chunk's end
// (K_ROWS_END)
#if defined(__AVX2__) && !defined(I8_PORTABLE)
#define K_SUPER(S, KB)                                                                           \
    {                                                                                        \
        K_SUPER_SCALES(KB, sw_)                                                              \
        _Pragma("unroll") for (int pp_ = 0; pp_ < 4; ++pp_) {                                \
            c32 w0_, w1_;                                                                    \
            s16v s0_, s1_;                                                                   \
            k_pair(qrow, 4 * (S) + pp_, &w0_, &w1_);                                         \
            K_PAIR_SCALES(sw_, pp_, s0_, s1_);                                               \
            K_ROWS_ACC;                                                                      \
            if ((pp_ + 1) % K_XPAIRS == 0) { K_ROWS_END(pp_ / K_XPAIRS); }                       \
        }                                                                                    \
    }
#define K_ACC1(I, XR) K_PAIR_ACC(I, w0_, w1_, s0_, s1_, (XR) + 64 * pp_)
#else
#define K_SUPER(S, KB)                                                                           \
    _Pragma("unroll") for (int pp_ = 0; pp_ < 4; ++pp_) {                                    \
        K_ROWS_ACC;                                                                          \
        if ((pp_ + 1) % K_XPAIRS == 0) { K_ROWS_END(pp_ / K_XPAIRS); }                           \
    }
#define K_ACC1(I, XR) I += k_pair_dot(qrow, 4 * s + pp_, kb, (XR) + 64 * pp_)
#endif

// y[r, o] (+)= sum_c W[o, c] x[r, c] for r < n_rows[0], x given as quantize_x8k's xq, dx, bsum and its
// fp32 block sums xsum [n, cols / 32] (Q4_K, Q5_K). One output row a work-item; cols % 256 == 0.
// Every (output, row) pair: per super-block its x-chunks' fmas in order, then the minimums' fma.
__kernel void gemv_int8k_rows(__global const float *d, __global const half *m, __global const uchar *q,
                              __global const char *xq, __global const float *dx, __global const short *bsum,
                              __global const float *xsum, __global float *y, const int cols, const int out_rows,
                              __global const int *n_rows, const int accumulate, const int y_offset,
                              const int y_stride)
{
    y += y_offset;
    const int o = get_global_id(0);
    if (o >= out_rows) return;
    const int nb = cols / 32, nbp = (nb + 3) & ~3, nsb = cols / 256, n = n_rows[0], nbs = cols / 16;
    const int ncx = cols / K_XB;  // x's scales a row
    __global const float *drow = DROW_AT(d, o, nbp);
    __global const half *mrow = MROW_AT(m, o, nbp);
    __global const uchar *qrow = q + (size_t)o * nb * QBYTES;
    int r0 = 0;
    for (; r0 + 4 <= n; r0 += 4) {  // four rows a pass, each pair unpacked once for them
        __global const char *x0 = xq + (size_t)r0 * cols, *x1 = x0 + cols, *x2 = x1 + cols, *x3 = x2 + cols;
        __global const float *d0 = dx + (size_t)r0 * ncx, *xs0 = xsum + (size_t)r0 * nb;
        float8 f0 = (float8)(0.0f), f1 = f0, f2 = f0, f3 = f0;
        for (int s = 0; s < nsb; ++s) {
            const uchar16 kb = vload16(s, MBYTES(mrow));
            const int c = 256 * s, e = s * (256 / K_XB);
            const float ds = K_DS(drow, s);
            int8 i0 = (int8)(0), i1 = i0, i2 = i0, i3 = i0;
            float8 t0 = (float8)(0.0f), t1 = t0, t2 = t0, t3 = t0;
#if QFMT == 62
            const short16 sc16 = convert_short16(as_char16(kb));
            __global const short *bs = bsum + (size_t)r0 * nbs + 16 * s;
            const short16 b0 = vload16(0, bs), b1 = vload16(0, bs + nbs), b2 = vload16(0, bs + 2 * nbs),
                          b3 = vload16(0, bs + 3 * nbs);
#else
            const short16 b0 = (short16)(0), b1 = b0, b2 = b0, b3 = b0;
#endif
#define K_ROWS_ACC K_ACC1(i0, x0 + c); K_ACC1(i1, x1 + c); K_ACC1(i2, x2 + c); K_ACC1(i3, x3 + c)
#define K_ROWS_END(C)                                                                            \
    K_END1(t0, i0, b0, d0[e + (C)], C) K_END1(t1, i1, b1, d0[ncx + e + (C)], C)              \
    K_END1(t2, i2, b2, d0[2 * ncx + e + (C)], C) K_END1(t3, i3, b3, d0[3 * ncx + e + (C)], C)
            K_SUPER(s, kb)
#undef K_ROWS_ACC
#undef K_ROWS_END
            const float8 mn = HAS_MINS ? K_MINS(kb, s) : (float8)(0.0f);
            K_SUPER_END(f0, t0, mn, xs0);
            K_SUPER_END(f1, t1, mn, xs0 + nb);
            K_SUPER_END(f2, t2, mn, xs0 + 2 * nb);
            K_SUPER_END(f3, t3, mn, xs0 + 3 * nb);
        }
        I8_STORE(r0, hsum8(f0));
        I8_STORE(r0 + 1, hsum8(f1));
        I8_STORE(r0 + 2, hsum8(f2));
        I8_STORE(r0 + 3, hsum8(f3));
    }
    for (; r0 < n; ++r0) {  // the last n % 4 rows alone, the same expression
        __global const char *x0 = xq + (size_t)r0 * cols;
        __global const float *d0 = dx + (size_t)r0 * ncx, *xs0 = xsum + (size_t)r0 * nb;
        float8 f0 = (float8)(0.0f);
        for (int s = 0; s < nsb; ++s) {
            const uchar16 kb = vload16(s, MBYTES(mrow));
            const int c = 256 * s, e = s * (256 / K_XB);
            const float ds = K_DS(drow, s);
            int8 i0 = (int8)(0);
            float8 t0 = (float8)(0.0f);
#if QFMT == 62
            const short16 sc16 = convert_short16(as_char16(kb));
            const short16 b0 = vload16(0, bsum + (size_t)r0 * nbs + 16 * s);
#else
            const short16 b0 = (short16)(0);
#endif
#define K_ROWS_ACC K_ACC1(i0, x0 + c)
#define K_ROWS_END(C) K_END1(t0, i0, b0, d0[e + (C)], C)
            K_SUPER(s, kb)
#undef K_ROWS_ACC
#undef K_ROWS_END
            K_SUPER_END(f0, t0, HAS_MINS ? K_MINS(kb, s) : (float8)(0.0f), xs0);
        }
        I8_STORE(r0, hsum8(f0));
    }
}
