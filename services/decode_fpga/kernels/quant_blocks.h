// One row's dot product with a vector, straight from GGUF blocks (layout and arithmetic: see
// gemv_quant.cl), shared by gemv_quant.cl and decode_layers.cl, which include this file;
// DeviceContext.build inlines it. Defines: QFMT (40 Q4_0, 41 Q4_1, 80 Q8_0), and XAS, the
// address space of the vector (__global or __local), before the include.

#if QFMT == 80
#define QBYTES 32
#else
#define QBYTES 16
#endif

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

// sum_j q_bj * x_bj of block b as 16 lanes (Q4_0: (q - 8)), before the block's scale
inline float16 block_dot(__global const uchar *q, const int b, XAS const float *x)
{
#if QFMT == 80
    __global const char *qc = (__global const char *)q;
    const float16 w0 = convert_float16(vload16(2 * b, qc)), w1 = convert_float16(vload16(2 * b + 1, qc));
#else
    const uint16 qi = convert_uint16(vload16(b, q));
#if QFMT == 40
    const float16 w0 = convert_float16(convert_int16(qi & (uint16)(0x0F)) - 8);
    const float16 w1 = convert_float16(convert_int16(qi >> (uint16)(4)) - 8);
#else
    const float16 w0 = convert_float16(qi & (uint16)(0x0F)), w1 = convert_float16(qi >> (uint16)(4));
#endif
#endif
    return fma(w1, vload16(2 * b + 1, x), w0 * vload16(2 * b, x));
}

// ACC = sum_c W[o, c] * X[c] of one row o (DROW, MROW, QROW: its scales, minimums and quants),
// the scales out of the inner loop, two accumulators taking blocks in turn, Q4_1's minimums
// through the block sums XSUM. A macro, not a function: the same loop in a function measured
// 5-10% slower on PoCL (interleaved A/B runs on a 92160x576 Q4_1 matrix), though it was inlined.
#define ROW_DOT(ACC, DROW, MROW, QROW, X, XSUM, NB)                                            \
    do {                                                                                       \
        float16 a0_ = (float16)(0.0f), a1_ = a0_;                                              \
        int b_ = 0;                                                                            \
        for (; b_ + 2 <= (NB); b_ += 2) {                                                      \
            a0_ = fma(block_dot((QROW), b_, (X)), (float16)((DROW)[b_]), a0_);                 \
            a1_ = fma(block_dot((QROW), b_ + 1, (X)), (float16)((DROW)[b_ + 1]), a1_);         \
        }                                                                                      \
        if (b_ < (NB)) a0_ = fma(block_dot((QROW), b_, (X)), (float16)((DROW)[b_]), a0_);      \
        ACC = hsum16(a0_ + a1_);                                                               \
        if (QFMT == 41) {                                                                      \
            const int ng_ = (NB) / 4;                                                          \
            float4 ms_ = (float4)(0.0f);                                                       \
            for (int g_ = 0; g_ < ng_; ++g_) ms_ = fma(vload_half4(g_, (MROW)), vload4(g_, (XSUM)), ms_); \
            ACC += (ms_.x + ms_.y) + (ms_.z + ms_.w);                                          \
            if ((NB) > 4 * ng_) { /* 1-3 blocks left; minimums are padded to 4 */              \
                const float4 m4_ = vload_half4(ng_, (MROW));                                   \
                for (b_ = 4 * ng_; b_ < (NB); ++b_) ACC += pick4(m4_, b_ & 3) * (XSUM)[b_];    \
            }                                                                                  \
        }                                                                                      \
    } while (0)

// Y[O] (+)= row O of the [rows, COLS] matrix (D, M, Q) . X (XSUM: its block sums): one output of
// the one-row kernels (gemv_quant.cl's prologue builds, decode_layers.cl). COLS % 32 == 0.
#define GEMV_ROW(O, D, M, Q, X, XSUM, COLS, Y, ACCUMULATE)                                     \
    do {                                                                                       \
        const int nb_o_ = (COLS) / 32, nbp_o_ = (nb_o_ + 3) & ~3;                              \
        float acc_o_;                                                                          \
        ROW_DOT(acc_o_, (D) + (size_t)(O) * nbp_o_, (M) + (size_t)(O) * nbp_o_,                \
                (Q) + (size_t)(O) * nb_o_ * QBYTES, (X), (XSUM), nb_o_);                       \
        (Y)[O] = (ACCUMULATE) ? (Y)[O] + acc_o_ : acc_o_;                                      \
    } while (0)
