// RMSNorm of one row into local memory, with the expression of norm.cl's rms_norm, and the
// sums of its 32-blocks (a Q4_1 GEMV reads them): the prologue of gemv_quant_norm
// (gemv_quant.cl) and a phase of decode_layers.cl, which include this file, so both round alike.
// COLS: a compile-time multiple of 32. XN: COLS floats, XSUM: COLS / 32 floats.
#define RMS_NORM_ROW(XN, XSUM, X, W, EPS, COLS)                                                    \
    do {                                                                                        \
        float4 ss_ = (float4)(0.0f);                                                            \
        for (int i_ = 0; i_ < (COLS) / 4; ++i_) { const float4 v_ = vload4(i_, (X)); ss_ = fma(v_, v_, ss_); } \
        const float scale_ = rsqrt((ss_.x + ss_.y + ss_.z + ss_.w) / (COLS) + (EPS));          \
        for (int b_ = 0; b_ < (COLS) / 32; ++b_) {                                              \
            float4 s4_ = (float4)(0.0f);                                                        \
            for (int i_ = 8 * b_; i_ < 8 * b_ + 8; ++i_) {                                      \
                const float4 v_ = vload4(i_, (W)) * (vload4(i_, (X)) * scale_);                 \
                vstore4(v_, i_, (XN));                                                          \
                s4_ += v_;                                                                      \
            }                                                                                   \
            (XSUM)[b_] = (s4_.x + s4_.y) + (s4_.z + s4_.w);                                     \
        }                                                                                       \
    } while (0)
