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
//   42 Q4_K  d q + m           52 Q5_K  d q + m       (d = d_super sc_b, m = -(dmin_super mn_b))
//   62 Q6_K  d_h (q - 32), one scale a 16 weights   (d_h = d_super sc_h)
// Every product d q is exact in fp32 (at most 11 + 7 + 6 bits), as are d_super sc and
// dmin_super mn, so the weights are gguf's bit for bit however the kernels order them (the one
// rounding is the minimum's addition).
//
// Scales and minimums, per row: d float [nbp] (the blocks' own, widened from fp16) and m half
// [nbp] (Q4_1, Q5_1); the K-quants keep their super-blocks' fp16 scales as floats in d (Q4_K,
// Q5_K: d_super, dmin_super of each 256 weights; Q6_K: d_super) and their small integer
// scales as bytes in m (Q4_K, Q5_K: sc_b, mn_b of each block; Q6_K: sc_h of each half, int8),
// read through the kernels' `half *m` argument: ~4.75 bits a weight for Q4_K, not 6 with an fp32
// scale and minimum a block.

// quant bytes per block: 16 of low nibbles (byte j: weight j | weight j + 16 << 4); Q5: then the
// 32 fifth bits as one little-endian uint; Q6_K: 16 bytes (byte j: weight j's 6 bits | weight
// j + 16's low 2 bits << 6), then weight 16 + j's high 4 bits at bit 32 (j & 1) + 4 (j >> 1) of a
// little-endian ulong; Q8_0: 32 int8
#define QBYTES_F(F) ((F) == 80 ? 32 : ((F) == 50 || (F) == 51 || (F) == 52) ? 20 : (F) == 62 ? 24 : 16)
#define DPER_F(F) ((F) == 62 ? 2 : 1)  // scales per block: Q6_K has one per 16 weights
#define KQ_F(F) ((F) == 42 || (F) == 52 || (F) == 62)  // super-block scales and byte scales
#define HAS_MINS_F(F) ((F) == 41 || (F) == 51 || (F) == 42 || (F) == 52)
// floats of d per row (NBP: the row's blocks rounded up to 4; a whole number of super-blocks for K)
#define DSTRIDE_F(F, NBP) ((F) == 62 ? (NBP) / 8 : ((F) == 42 || (F) == 52) ? (NBP) / 4 : (NBP))
#define DROW_AT_F(F, D, O, NBP) ((D) + (size_t)(O) * DSTRIDE_F(F, NBP))
// m's row: NBP halves, or for K 2 bytes a block
#define MROW_AT_F(F, M, O, NBP)                                                                \
    (KQ_F(F) ? (__global const half *)((__global const uchar *)(M) + (size_t)(O) * 2 * (NBP))     \
             : (M) + (size_t)(O) * (NBP))
#define MBYTES(MROW) ((__global const uchar *)(MROW))
// block B's scale (one-scale formats), half H's scale (Q6_K)
#define SCALE_F(F, DROW, MROW, B)                                                              \
    (((F) == 42 || (F) == 52) ? (DROW)[2 * ((B) >> 3)] * (float)MBYTES(MROW)[2 * (B)] : (DROW)[B])
#define HALF_SCALE_F(F, DROW, MROW, B, H)                                                      \
    ((F) == 62 ? (DROW)[(B) >> 3] * (float)((__global const char *)(MROW))[2 * (B) + (H)]    \
               : SCALE_F(F, DROW, MROW, B))
// the minimums of blocks 4G..4G+3, and of block B
#define LOAD_MIN4_F(F, G, MROW, DROW)                                                          \
    (KQ_F(F) ? -(DROW)[2 * ((G) >> 1) + 1] * convert_float4(vload8((G), MBYTES(MROW)).odd)     \
             : vload_half4((G), (MROW)))
#define MIN_AT_F(F, MROW, B, DROW)                                                             \
    (KQ_F(F) ? -(DROW)[2 * ((B) >> 3) + 1] * (float)MBYTES(MROW)[2 * (B) + 1] : vload_half((B), (MROW)))

inline float hsum16(const float16 a)
{
    const float8 s8 = a.lo + a.hi;
    const float4 s4 = s8.lo + s8.hi;
    return (s4.x + s4.y) + (s4.z + s4.w);
}

inline float hsum8(const float8 a)
{
    const float4 s4 = a.lo + a.hi;
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
        // byte j: weight j whole (6 bits) and weight 16 + j's low 2 bits; weight 16 + j's high 4
        // bits in the uints after them (QBYTES * b + 16: 8-byte aligned), the even j's in the first
        // and the odd in the second at bit 4 (j >> 1), so both uints broadcast in one load and each
        // lane rotates its own 4 bits to bits 2..5 (vprolvd); weights 0..15 need only a mask (one
        // 8192x2048 GEMV: 800 -> 690 us of CPU against 2-bit highs for every weight)
        __global const uchar *qb = q + QBYTES_F(F) * b;
        const uint16 qi = convert_uint16(vload16(0, qb));
        // lane j's nibble (bit 4 (j >> 1) of its uint) shifted right to bits 2..5: lanes 0..7 from the
        // uints shifted up by 2 first (nibbles 0..3 only: nothing they need falls off the top), so
        // every lane shifts right, one vpsrlvd (AVX2 has no vector rotate: it took 3 instructions)
        const uint2 h2 = vload2(0, (__global const uint *)(qb + 16));
        const uint2 u2 = h2 << (uint2)(2);
        const uint16 h = (uint16)(u2, u2, u2, u2, h2, h2, h2, h2);
        const uint16 sh = (uint16)(0, 0, 4, 4, 8, 8, 12, 12, 14, 14, 18, 18, 22, 22, 26, 26);
        *w0 = convert_float16(convert_int16(qi & (uint16)(0x3F)) - 32);
        *w1 = convert_float16(convert_int16((qi >> (uint16)(6)) | ((h >> sh) & (uint16)(0x3C))) - 32);
    } else {  // 50, 51, 52: five bits
        __global const uchar *qb = q + QBYTES_F(F) * b;
        const uint16 qi = convert_uint16(vload16(0, qb));
        const uint hw = *(__global const uint *)(qb + 16);  // QBYTES * b + 16: 4-byte aligned
        // weight j's fifth bit (bit j of hw) shifted right to bit 4 of lane j: weights 0..7 from hw
        // shifted up by 4 first (their bits stay), the others straight, so every lane takes one
        // vpsrlvd and a mask (AVX2 has no vector rotate: the rotate this replaces was 3 instructions)
        const uint8 hu = (uint8)(hw << 4), hd = (uint8)(hw);
        const uint16 lo = (qi & (uint16)(0x0F)) |
                          (((uint16)(hu, hd) >> (uint16)(0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7, 8, 9, 10, 11)) & (uint16)(0x10));
        const uint16 hi = (qi >> (uint16)(4)) |
                          (((uint16)(hd, hd) >> (uint16)(12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27)) & (uint16)(0x10));
        if (F == 50) {
            *w0 = convert_float16(convert_int16(lo) - 16);
            *w1 = convert_float16(convert_int16(hi) - 16);
        } else {
            *w0 = convert_float16(lo);
            *w1 = convert_float16(hi);
        }
    }
}

// The factored sums. A block's weights are d (q - offset) (+ m): sum_j w_j x_j = d sum_j q_j x_j
// (+ m sum_j x_j), so the scale multiplies a block's 8-lane partial sum once and the minimum the
// block's sum of x (computed once per row of x, shared by every output). A block's products fold
// to 8 lanes in one fixed order, weights 0-7, 8-15, 16-23, 24-31 (one multiply and three fmas),
// where 16 lanes cost a multiply, an fma and an fma by the scale for each half: 5 instructions
// for 32 weights instead of 6, and every kernel sums a (block, row) in this same order.
inline float8 block_dot8(const float16 w0, const float16 w1, XAS const float *x, const int b)
{
    float8 p = w0.lo * vload8(4 * b, x);
    p = fma(w0.hi, vload8(4 * b + 1, x), p);
    p = fma(w1.lo, vload8(4 * b + 2, x), p);
    return fma(w1.hi, vload8(4 * b + 3, x), p);
}

// Q6_K's halves (a scale per 16 weights): half h (weights 16 h .. 16 h + 15 of the row) folded to
// 8 lanes, before its scale. Scaling each weight first cost 4 multiplies a block more.
inline float8 half_dot8(const float16 w, XAS const float *x, const int h)
{
    return fma(w.hi, vload8(2 * h + 1, x), w.lo * vload8(2 * h, x));
}

// sum_j q_bj * x_bj of block b as 8 lanes (Q4_0: (q - 8)), before the block's scale
inline float8 block_dot_f(const int F, __global const uchar *q, const int b, XAS const float *x)
{
    float16 w0, w1;
    block_weights_f(F, q, b, &w0, &w1);
    return block_dot8(w0, w1, x, b);
}

// Block b's weights dequantized as far as the scales: block_weights_f's, and for Q6_K (two scales
// a block) those times their half's scale, gguf's weights themselves, each an exact product (the
// embedding lookup's; the GEMVs scale the sums instead).
inline void block_terms_f(const int F, __global const uchar *q, const int b, __global const float *drow,
                          __global const half *mrow, float16 *w0, float16 *w1)
{
    block_weights_f(F, q, b, w0, w1);
    if (DPER_F(F) == 2) {
        *w0 *= HALF_SCALE_F(F, drow, mrow, b, 0);
        *w1 *= HALF_SCALE_F(F, drow, mrow, b, 1);
    }
}

// A (float8) += block B (weights W0, W1 from block_weights_f) times X with its scales SE, SO (Q6_K:
// its halves'; else SE is the block's): the factored sum, the one expression of the one-row kernels
// (ROW_DOT) and of the batched ones (gemv_quant.cl), so a row rounds alike in every batch.
#define SCALES_ACC_F(F, A, W0, W1, X, B, SE, SO)                                               \
    do {                                                                                       \
        if (DPER_F(F) == 2) {                                                                  \
            A = fma(half_dot8((W0), (X), 2 * (B)), (float8)(SE), A);                           \
            A = fma(half_dot8((W1), (X), 2 * (B) + 1), (float8)(SO), A);                       \
        } else {                                                                               \
            A = fma(block_dot8((W0), (W1), (X), (B)), (float8)(SE), A);                        \
        }                                                                                      \
    } while (0)
// the same with the scales read from the row's arrays (DROW, MROW)
#define BLOCK_ACC_F(F, A, W0, W1, X, B, DROW, MROW)                                            \
    SCALES_ACC_F(F, A, W0, W1, X, B, HALF_SCALE_F(F, DROW, MROW, B, 0), HALF_SCALE_F(F, DROW, MROW, B, 1))
#define ROW_BLOCK_F(F, A, QROW, DROW, MROW, B, X)                                              \
    do {                                                                                       \
        float16 w0_, w1_;                                                                      \
        block_weights_f((F), (QROW), (B), &w0_, &w1_);                                         \
        BLOCK_ACC_F(F, A, w0_, w1_, (X), (B), (DROW), (MROW));                                 \
    } while (0)

// A K-quant super-block's 8 blocks' byte scales (and minimums), converted once for the 8: one
// 16-byte load and one conversion where a block at a time cost two scalar loads, a conversion
// and a multiply per scale. KQ_SUPER_F multiplies them by d: lanes 2k, 2k + 1 are block k's
// halves' scales (Q6_K), lane 2k its scale and lane 2k + 1 its minimum's byte (Q4_K, Q5_K; times
// -dmin). Each product is HALF_SCALE_F's (LOAD_MIN4_F's), the same exact fp32 multiply.
#define KQ_BYTES_F(F, MROW, S)                                                                 \
    ((F) == 62 ? convert_float16(vload16((S), (__global const char *)(MROW)))                 \
               : convert_float16(vload16((S), MBYTES(MROW))))
// A += block B times X with its scales SE, SO (first and second half): ROW_BLOCK_F's arithmetic
#define KQ_BLOCK_F(F, A, QROW, SE, SO, B, X)                                                   \
    do {                                                                                       \
        float16 w0_, w1_;                                                                      \
        block_weights_f((F), (QROW), (B), &w0_, &w1_);                                         \
        SCALES_ACC_F(F, A, w0_, w1_, (X), (B), (SE), (SO));                                    \
    } while (0)
// super-block S's 8 blocks, even ones into A0 and odd into A1 as ROW_DOT_F's pairs take them, and
// (Q4_K, Q5_K) its minimums times the block sums XSUM into MS, 4 blocks an fma as ROW_DOT_F's
// minimum loop takes them
#define KQ_SUPER_F(F, A0, A1, MS, QROW, DROW, MROW, S, X, XSUM)                                \
    do {                                                                                       \
        const float16 k_ = KQ_BYTES_F(F, (MROW), (S));                                         \
        const float16 sc_ = (DROW)[(F) == 62 ? (S) : 2 * (S)] * k_;                            \
        if (HAS_MINS_F(F)) {                                                                   \
            const float8 mn_ = -(DROW)[2 * (S) + 1] * k_.odd;                                  \
            MS = fma(mn_.lo, vload4(2 * (S), (XSUM)), MS);                                     \
            MS = fma(mn_.hi, vload4(2 * (S) + 1, (XSUM)), MS);                                 \
        }                                                                                      \
        const int b8_ = 8 * (S);                                                               \
        KQ_BLOCK_F(F, A0, (QROW), sc_.s0, sc_.s1, b8_, (X));                                   \
        KQ_BLOCK_F(F, A1, (QROW), sc_.s2, sc_.s3, b8_ + 1, (X));                               \
        KQ_BLOCK_F(F, A0, (QROW), sc_.s4, sc_.s5, b8_ + 2, (X));                               \
        KQ_BLOCK_F(F, A1, (QROW), sc_.s6, sc_.s7, b8_ + 3, (X));                               \
        KQ_BLOCK_F(F, A0, (QROW), sc_.s8, sc_.s9, b8_ + 4, (X));                               \
        KQ_BLOCK_F(F, A1, (QROW), sc_.sa, sc_.sb, b8_ + 5, (X));                               \
        KQ_BLOCK_F(F, A0, (QROW), sc_.sc, sc_.sd, b8_ + 6, (X));                               \
        KQ_BLOCK_F(F, A1, (QROW), sc_.se, sc_.sf, b8_ + 7, (X));                               \
    } while (0)

// ACC = sum_c W[o, c] * X[c] of one row o (DROW, MROW, QROW: its scales, minimums and quants),
// the scales out of the inner loop, two accumulators taking blocks in turn, the minimums
// through the block sums XSUM. A macro, not a function: the same loop in a function measured
// 5-10% slower on PoCL (interleaved A/B runs on a 92160x576 Q4_1 matrix), though it was inlined.
// K-quants (whole super-blocks) go a super-block at a time, the same terms in the same order.
#define ROW_DOT_F(F, ACC, DROW, MROW, QROW, X, XSUM, NB)                                       \
    do {                                                                                       \
        float8 a0_ = (float8)(0.0f), a1_ = a0_;                                                \
        int b_ = 0;                                                                            \
        if (KQ_F(F)) { /* whole super-blocks, the minimums in the same pass */                 \
            float4 ms_ = (float4)(0.0f);                                                       \
            for (int s_ = 0; s_ < (NB) / 8; ++s_)                                              \
                KQ_SUPER_F(F, a0_, a1_, ms_, (QROW), (DROW), (MROW), s_, (X), (XSUM));         \
            ACC = hsum8(a0_ + a1_);                                                             \
            if (HAS_MINS_F(F)) ACC += (ms_.x + ms_.y) + (ms_.z + ms_.w);                       \
            break; /* out of this do-while: the row is done */                              \
        }                                                                                      \
        for (; b_ + 2 <= (NB); b_ += 2) {                                                      \
            ROW_BLOCK_F(F, a0_, (QROW), (DROW), (MROW), b_, (X));                              \
            ROW_BLOCK_F(F, a1_, (QROW), (DROW), (MROW), b_ + 1, (X));                          \
        }                                                                                      \
        if (b_ < (NB)) ROW_BLOCK_F(F, a0_, (QROW), (DROW), (MROW), b_, (X));                   \
        ACC = hsum8(a0_ + a1_);                                                                 \
        if (HAS_MINS_F(F)) {                                                                   \
            const int ng_ = (NB) / 4;                                                          \
            float4 ms_ = (float4)(0.0f);                                                       \
            for (int g_ = 0; g_ < ng_; ++g_) ms_ = fma(LOAD_MIN4_F(F, g_, (MROW), (DROW)), vload4(g_, (XSUM)), ms_); \
            ACC += (ms_.x + ms_.y) + (ms_.z + ms_.w);                                          \
            if ((NB) > 4 * ng_) { /* 1-3 blocks left; minimums are padded to 4 */              \
                const float4 m4_ = LOAD_MIN4_F(F, ng_, (MROW), (DROW));                        \
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

// GEMV_ROW_F for the NR rows of X (at most ROWS, a compile-time bound; row r at X + r XS, its block
// sums at XSUM + r XSS) into Y[r YS + O]: each row's terms are ROW_DOT_F's, in its order and into its
// two accumulators, so each row gets the bits GEMV_ROW_F gives it alone; each block's weights are
// converted once for all the rows (decode_layers.cl's several-row step).
#define GEMV_ROW_N_F(F, O, D, M, Q, X, XS, XSUM, XSS, NR, COLS, Y, YS, ACCUMULATE)                 \
    do {                                                                                       \
        const int nb_ = (COLS) / 32, nbp_ = (nb_ + 3) & ~3;                                    \
        __global const float *drow_ = DROW_AT_F(F, (D), (O), nbp_);                            \
        __global const half *mrow_ = MROW_AT_F(F, (M), (O), nbp_);                             \
        __global const uchar *qrow_ = (Q) + (size_t)(O) * nb_ * QBYTES_F(F);                   \
        float8 a0_[ROWS], a1_[ROWS];                                                           \
        float4 ms_[ROWS];                                                                      \
        float16 w0_, w1_;                                                                      \
        for (int r_ = 0; r_ < (NR); ++r_) {                                                    \
            a0_[r_] = (float8)(0.0f); a1_[r_] = a0_[r_]; ms_[r_] = (float4)(0.0f);             \
        }                                                                                      \
        if (KQ_F(F)) { /* whole super-blocks: KQ_SUPER_F's terms, a row at a time per block */ \
            for (int s_ = 0; s_ < nb_ / 8; ++s_) {                                             \
                const float16 k_ = KQ_BYTES_F(F, mrow_, s_);                                   \
                const float16 sc_ = drow_[(F) == 62 ? s_ : 2 * s_] * k_;                       \
                if (HAS_MINS_F(F)) {                                                           \
                    const float8 mn_ = -drow_[2 * s_ + 1] * k_.odd;                            \
                    for (int r_ = 0; r_ < (NR); ++r_) {                                        \
                        ms_[r_] = fma(mn_.lo, vload4(2 * s_, (XSUM) + r_ * (XSS)), ms_[r_]);   \
                        ms_[r_] = fma(mn_.hi, vload4(2 * s_ + 1, (XSUM) + r_ * (XSS)), ms_[r_]); \
                    }                                                                          \
                }                                                                              \
                const float sc8_[16] = {sc_.s0, sc_.s1, sc_.s2, sc_.s3, sc_.s4, sc_.s5, sc_.s6, sc_.s7, \
                                        sc_.s8, sc_.s9, sc_.sa, sc_.sb, sc_.sc, sc_.sd, sc_.se, sc_.sf}; \
                for (int k8_ = 0; k8_ < 8; k8_ += 2) {                                         \
                    block_weights_f((F), qrow_, 8 * s_ + k8_, &w0_, &w1_);                      \
                    for (int r_ = 0; r_ < (NR); ++r_)                                          \
                        SCALES_ACC_F(F, a0_[r_], w0_, w1_, (X) + r_ * (XS), 8 * s_ + k8_,      \
                                     sc8_[2 * k8_], sc8_[2 * k8_ + 1]);                         \
                    block_weights_f((F), qrow_, 8 * s_ + k8_ + 1, &w0_, &w1_);                  \
                    for (int r_ = 0; r_ < (NR); ++r_)                                          \
                        SCALES_ACC_F(F, a1_[r_], w0_, w1_, (X) + r_ * (XS), 8 * s_ + k8_ + 1,  \
                                     sc8_[2 * k8_ + 2], sc8_[2 * k8_ + 3]);                     \
                }                                                                              \
            }                                                                                  \
            for (int r_ = 0; r_ < (NR); ++r_) {                                                \
                float acc_ = hsum8(a0_[r_] + a1_[r_]);                                          \
                if (HAS_MINS_F(F)) acc_ += (ms_[r_].x + ms_[r_].y) + (ms_[r_].z + ms_[r_].w);  \
                __global float *y_ = (Y) + (size_t)r_ * (YS) + (O);                            \
                *y_ = (ACCUMULATE) ? *y_ + acc_ : acc_;                                        \
            }                                                                                  \
            break; /* out of this do-while: the rows are done */                              \
        }                                                                                      \
        int b_ = 0;                                                                            \
        for (; b_ + 2 <= nb_; b_ += 2) {                                                       \
            block_weights_f((F), qrow_, b_, &w0_, &w1_);                                       \
            for (int r_ = 0; r_ < (NR); ++r_)                                                  \
                BLOCK_ACC_F(F, a0_[r_], w0_, w1_, (X) + r_ * (XS), b_, drow_, mrow_);          \
            block_weights_f((F), qrow_, b_ + 1, &w0_, &w1_);                                   \
            for (int r_ = 0; r_ < (NR); ++r_)                                                  \
                BLOCK_ACC_F(F, a1_[r_], w0_, w1_, (X) + r_ * (XS), b_ + 1, drow_, mrow_);      \
        }                                                                                      \
        if (b_ < nb_) {                                                                        \
            block_weights_f((F), qrow_, b_, &w0_, &w1_);                                       \
            for (int r_ = 0; r_ < (NR); ++r_)                                                  \
                BLOCK_ACC_F(F, a0_[r_], w0_, w1_, (X) + r_ * (XS), b_, drow_, mrow_);          \
        }                                                                                      \
        for (int r_ = 0; r_ < (NR); ++r_) {                                                    \
            float acc_ = hsum8(a0_[r_] + a1_[r_]);                                              \
            if (HAS_MINS_F(F)) {                                                               \
                const int ng_ = nb_ / 4;                                                       \
                float4 m4s_ = (float4)(0.0f);                                                  \
                for (int g_ = 0; g_ < ng_; ++g_)                                               \
                    m4s_ = fma(LOAD_MIN4_F(F, g_, mrow_, drow_), vload4(g_, (XSUM) + r_ * (XSS)), m4s_); \
                acc_ += (m4s_.x + m4s_.y) + (m4s_.z + m4s_.w);                                 \
                if (nb_ > 4 * ng_) {                                                           \
                    const float4 m4_ = LOAD_MIN4_F(F, ng_, mrow_, drow_);                      \
                    for (int b2_ = 4 * ng_; b2_ < nb_; ++b2_)                                  \
                        acc_ += pick4(m4_, b2_ & 3) * ((XSUM) + r_ * (XSS))[b2_];              \
                }                                                                              \
            }                                                                                  \
            __global float *y_ = (Y) + (size_t)r_ * (YS) + (O);                                \
            *y_ = (ACCUMULATE) ? *y_ + acc_ : acc_;                                            \
        }                                                                                      \
    } while (0)

// ---- the one-format names, for the kernels built with -DQFMT ----
#ifdef QFMT
#define QBYTES QBYTES_F(QFMT)
#define DPER DPER_F(QFMT)
#define KQ KQ_F(QFMT)
#define HAS_MINS HAS_MINS_F(QFMT)
#define SCALE(DROW, MROW, B) SCALE_F(QFMT, DROW, MROW, B)
#define HALF_SCALE(DROW, MROW, B, H) HALF_SCALE_F(QFMT, DROW, MROW, B, H)
#define LOAD_MIN4(G, MROW, DROW) LOAD_MIN4_F(QFMT, G, MROW, DROW)
#define MIN_AT(MROW, B, DROW) MIN_AT_F(QFMT, MROW, B, DROW)
#define MROW_AT(M, O, NBP) MROW_AT_F(QFMT, M, O, NBP)
#define DROW_AT(D, O, NBP) DROW_AT_F(QFMT, D, O, NBP)
#define block_weights(Q, B, W0, W1) block_weights_f(QFMT, (Q), (B), (W0), (W1))
#define block_dot(Q, B, X) block_dot_f(QFMT, (Q), (B), (X))
#define block_terms(Q, B, DROW, MROW, W0, W1) block_terms_f(QFMT, (Q), (B), (DROW), (MROW), (W0), (W1))
#define BLOCK_ACC(A, W0, W1, X, B, DROW, MROW) BLOCK_ACC_F(QFMT, A, W0, W1, X, B, DROW, MROW)
#define ROW_DOT(ACC, DROW, MROW, QROW, X, XSUM, NB) ROW_DOT_F(QFMT, ACC, DROW, MROW, QROW, X, XSUM, NB)
#define GEMV_ROW(O, D, M, Q, X, XSUM, COLS, Y, ACCUMULATE) GEMV_ROW_F(QFMT, O, D, M, Q, X, XSUM, COLS, Y, ACCUMULATE)

// the ending of one row's two accumulators (ROW_DOT's order; the batched GEMVs, fp32 and int8 alike): their sum,
// then the minimums times x's fp32 block sums
inline float rows_finish(const float8 a0, const float8 a1, __global const float *drow, __global const half *mrow,
                         __global const float *xsum, const int nb)
{
    float acc = hsum8(a0 + a1);
    if (HAS_MINS) {
        const int ng = nb / 4;
        float4 ms = (float4)(0.0f);
        for (int g = 0; g < ng; ++g) ms = fma(LOAD_MIN4(g, mrow, drow), vload4(g, xsum), ms);
        acc += (ms.x + ms.y) + (ms.z + ms.w);
        if (nb > 4 * ng) {
            const float4 m4 = LOAD_MIN4(ng, mrow, drow);
            for (int b = 4 * ng; b < nb; ++b) acc += pick4(m4, b & 3) * xsum[b];
        }
    }
    return acc;
}
#endif
