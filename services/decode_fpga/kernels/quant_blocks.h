// One row's dot product with a vector, straight from GGUF blocks (layout and arithmetic: see
// gemv_quant.cl), shared by gemv_quant.cl, gemv_quant_wg.cl and decode_layers.cl, which include
// this file; DeviceContext.build inlines it. Define XAS, the address space of the vector
// (__global or __local), before the include, and QFMT (a format's code, below) for the
// one-format names (ROW_DOT, GEMV_ROW, QBYTES, ...). The *_F forms take the format as their first
// argument, a constant wherever they are used, so the compiler keeps only that format's code:
// decode_layers.cl instantiates one per format its model holds and picks per matrix.
//
// Formats, each a 32-weight block on the device (quant_gemv.py's split_blocks repacks the
// file's blocks; K-quant super-blocks of 256 become 8 such blocks):
//   40 Q4_0  d (q - 8)         41 Q4_1  d q + m (m fp16)    80 Q8_0  d q
//   50 Q5_0  d (q - 16)        51 Q5_1  d q + m (m fp16)
//   42 Q4_K  d q + m           52 Q5_K  d q + m             (d = d_super sc, m = -dmin_super mn, fp32)
//   62 Q6_K  d_h (q - 32), one scale d_h per 16 weights (d_super sc_h, fp32)
// Every product d q is exact in fp32 (at most 11 + 7 + 6 bits), so the weights are gguf's bit
// for bit however the kernels order them (the one rounding is the minimum's addition).

// quant bytes per block: 16 of low nibbles (byte j: weight j | weight j + 16 << 4); Q5: then the
// 32 fifth bits as one little-endian uint; Q6_K: then 8 bytes of 2-bit highs (byte j: weights j,
// j + 8, j + 16, j + 24); Q8_0: 32 int8
#define QBYTES_F(F) ((F) == 80 ? 32 : ((F) == 50 || (F) == 51 || (F) == 52) ? 20 : (F) == 62 ? 24 : 16)
#define DPER_F(F) ((F) == 62 ? 2 : 1)  // scales per block: Q6_K has one per 16 weights
// minimums: Q4_1 and Q5_1 fp16 as in the file; Q4_K and Q5_K fp32 (dmin times a 6-bit integer
// needs 17 bits), read through the kernels' `half *m` argument
#define HAS_MINS_F(F) ((F) == 41 || (F) == 51 || (F) == 42 || (F) == 52)
#define MINS_F32_F(F) ((F) == 42 || (F) == 52)
#define LOAD_MIN4_F(F, G, MROW) (MINS_F32_F(F) ? vload4((G), (__global const float *)(MROW)) : vload_half4((G), (MROW)))
#define MIN_AT_F(F, MROW, B) (MINS_F32_F(F) ? ((__global const float *)(MROW))[B] : vload_half((B), (MROW)))
#define MROW_AT_F(F, M, O, NBP)                                                                \
    (MINS_F32_F(F) ? (__global const half *)((__global const float *)(M) + (size_t)(O) * (NBP)) \
                   : (M) + (size_t)(O) * (NBP))
#define DROW_AT_F(F, D, O, NBP) ((D) + (size_t)(O) * (NBP) * DPER_F(F))

inline float hsum16(const float16 a)
{
    const float8 s8 = a.lo + a.hi;
    const float4 s4 = s8.lo + s8.hi;
    return (s4.x + s4.y) + (s4.z + s4.w);
}

inline float pick4(const float4 v, const int i)
{
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// the 32 weights of block b of a row before its scale (and minimum): w0 = weights 0..15,
// w1 = weights 16..31 (Q4_0, Q5_0, Q6_K with their offsets already subtracted)
inline void block_weights_f(const int F, __global const uchar *q, const int b, float16 *w0, float16 *w1)
{
    if (F == 80) {
        __global const char *qc = (__global const char *)q;
        *w0 = convert_float16(vload16(2 * b, qc));
        *w1 = convert_float16(vload16(2 * b + 1, qc));
    } else if (F == 40 || F == 41 || F == 42) {
        const uint16 qi = convert_uint16(vload16(b, q));
        if (F == 40) {
            *w0 = convert_float16(convert_int16(qi & (uint16)(0x0F)) - 8);
            *w1 = convert_float16(convert_int16(qi >> (uint16)(4)) - 8);
        } else {
            *w0 = convert_float16(qi & (uint16)(0x0F));
            *w1 = convert_float16(qi >> (uint16)(4));
        }
    } else if (F == 62) {
        __global const uchar *qb = q + QBYTES_F(F) * b;
        const uint16 qi = convert_uint16(vload16(0, qb));
        const uint8 h8 = convert_uint8(vload8(0, qb + 16));
        const uint16 h0 = (uint16)(h8 & (uint8)(3), (h8 >> (uint8)(2)) & (uint8)(3));
        const uint16 h1 = (uint16)((h8 >> (uint8)(4)) & (uint8)(3), h8 >> (uint8)(6));
        *w0 = convert_float16(convert_int16((qi & (uint16)(0x0F)) | (h0 << (uint16)(4))) - 32);
        *w1 = convert_float16(convert_int16((qi >> (uint16)(4)) | (h1 << (uint16)(4))) - 32);
    } else {  // 50, 51, 52: five bits
        __global const uchar *qb = q + QBYTES_F(F) * b;
        const uint16 qi = convert_uint16(vload16(0, qb));
        const uint16 h = (uint16)(*(__global const uint *)(qb + 16));  // QBYTES * b + 16: 4-byte aligned
        const uint16 sh = (uint16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const uint16 lo = (qi & (uint16)(0x0F)) | (((h >> sh) & (uint16)(1)) << (uint16)(4));
        const uint16 hi = (qi >> (uint16)(4)) | (((h >> (sh + (uint16)(16))) & (uint16)(1)) << (uint16)(4));
        if (F == 50) {
            *w0 = convert_float16(convert_int16(lo) - 16);
            *w1 = convert_float16(convert_int16(hi) - 16);
        } else {
            *w0 = convert_float16(lo);
            *w1 = convert_float16(hi);
        }
    }
}

// sum_j q_bj * x_bj of block b as 16 lanes (Q4_0: (q - 8)), before the block's scale
inline float16 block_dot_f(const int F, __global const uchar *q, const int b, XAS const float *x)
{
    float16 w0, w1;
    block_weights_f(F, q, b, &w0, &w1);
    return fma(w1, vload16(2 * b + 1, x), w0 * vload16(2 * b, x));
}

// A += block B of a row (quants QROW, scales DROW) times X, scaled: one scale a block, or
// Q6_K's two (the 16-weight halves scaled apart). The one expression of the one-row kernels
// (ROW_DOT) and of gemv_quant_rows (gemv_quant.cl), so they round alike.
#define BLOCK_ACC_F(F, A, W0, W1, X, B, DROW)                                                  \
    do {                                                                                       \
        if (DPER_F(F) == 2)                                                                    \
            A = fma((W1) * vload16(2 * (B) + 1, (X)), (float16)((DROW)[2 * (B) + 1]),          \
                    fma((W0) * vload16(2 * (B), (X)), (float16)((DROW)[2 * (B)]), A));         \
        else                                                                                   \
            A = fma(fma((W1), vload16(2 * (B) + 1, (X)), (W0) * vload16(2 * (B), (X))),        \
                    (float16)((DROW)[B]), A);                                                  \
    } while (0)
#define ROW_BLOCK_F(F, A, QROW, DROW, B, X)                                                    \
    do {                                                                                       \
        if (DPER_F(F) == 2) {                                                                  \
            float16 w0_, w1_;                                                                  \
            block_weights_f((F), (QROW), (B), &w0_, &w1_);                                     \
            BLOCK_ACC_F(F, A, w0_, w1_, (X), (B), (DROW));                                     \
        } else {                                                                               \
            A = fma(block_dot_f((F), (QROW), (B), (X)), (float16)((DROW)[B]), A);              \
        }                                                                                      \
    } while (0)

// ACC = sum_c W[o, c] * X[c] of one row o (DROW, MROW, QROW: its scales, minimums and quants),
// the scales out of the inner loop, two accumulators taking blocks in turn, the minimums
// through the block sums XSUM. A macro, not a function: the same loop in a function measured
// 5-10% slower on PoCL (interleaved A/B runs on a 92160x576 Q4_1 matrix), though it was inlined.
#define ROW_DOT_F(F, ACC, DROW, MROW, QROW, X, XSUM, NB)                                       \
    do {                                                                                       \
        float16 a0_ = (float16)(0.0f), a1_ = a0_;                                              \
        int b_ = 0;                                                                            \
        for (; b_ + 2 <= (NB); b_ += 2) {                                                      \
            ROW_BLOCK_F(F, a0_, (QROW), (DROW), b_, (X));                                      \
            ROW_BLOCK_F(F, a1_, (QROW), (DROW), b_ + 1, (X));                                  \
        }                                                                                      \
        if (b_ < (NB)) ROW_BLOCK_F(F, a0_, (QROW), (DROW), b_, (X));                           \
        ACC = hsum16(a0_ + a1_);                                                               \
        if (HAS_MINS_F(F)) {                                                                   \
            const int ng_ = (NB) / 4;                                                          \
            float4 ms_ = (float4)(0.0f);                                                       \
            for (int g_ = 0; g_ < ng_; ++g_) ms_ = fma(LOAD_MIN4_F(F, g_, (MROW)), vload4(g_, (XSUM)), ms_); \
            ACC += (ms_.x + ms_.y) + (ms_.z + ms_.w);                                          \
            if ((NB) > 4 * ng_) { /* 1-3 blocks left; minimums are padded to 4 */              \
                const float4 m4_ = LOAD_MIN4_F(F, ng_, (MROW));                                \
                for (b_ = 4 * ng_; b_ < (NB); ++b_) ACC += pick4(m4_, b_ & 3) * (XSUM)[b_];    \
            }                                                                                  \
        }                                                                                      \
    } while (0)

// Y[O] (+)= row O of the [rows, COLS] matrix (D, M, Q) . X (XSUM: its block sums): one output of
// the one-row kernels (gemv_quant.cl's prologue builds, decode_layers.cl). COLS % 32 == 0.
#define GEMV_ROW_F(F, O, D, M, Q, X, XSUM, COLS, Y, ACCUMULATE)                                \
    do {                                                                                       \
        const int nb_o_ = (COLS) / 32, nbp_o_ = (nb_o_ + 3) & ~3;                              \
        float acc_o_;                                                                          \
        ROW_DOT_F(F, acc_o_, DROW_AT_F(F, (D), (O), nbp_o_), MROW_AT_F(F, (M), (O), nbp_o_),   \
                  (Q) + (size_t)(O) * nb_o_ * QBYTES_F(F), (X), (XSUM), nb_o_);                \
        (Y)[O] = (ACCUMULATE) ? (Y)[O] + acc_o_ : acc_o_;                                      \
    } while (0)

// ---- the one-format names, for the kernels built with -DQFMT ----
#ifdef QFMT
#define QBYTES QBYTES_F(QFMT)
#define DPER DPER_F(QFMT)
#define HAS_MINS HAS_MINS_F(QFMT)
#define MINS_F32 MINS_F32_F(QFMT)
#define LOAD_MIN4(G, MROW) LOAD_MIN4_F(QFMT, G, MROW)
#define MIN_AT(MROW, B) MIN_AT_F(QFMT, MROW, B)
#define MROW_AT(M, O, NBP) MROW_AT_F(QFMT, M, O, NBP)
#define DROW_AT(D, O, NBP) DROW_AT_F(QFMT, D, O, NBP)
#define block_weights(Q, B, W0, W1) block_weights_f(QFMT, (Q), (B), (W0), (W1))
#define block_dot(Q, B, X) block_dot_f(QFMT, (Q), (B), (X))
#define BLOCK_ACC(A, W0, W1, X, B, DROW) BLOCK_ACC_F(QFMT, A, W0, W1, X, B, DROW)
#define ROW_DOT(ACC, DROW, MROW, QROW, X, XSUM, NB) ROW_DOT_F(QFMT, ACC, DROW, MROW, QROW, X, XSUM, NB)
#define GEMV_ROW(O, D, M, Q, X, XSUM, COLS, Y, ACCUMULATE) GEMV_ROW_F(QFMT, O, D, M, Q, X, XSUM, COLS, Y, ACCUMULATE)
#endif
