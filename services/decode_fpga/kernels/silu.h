// act = silu(gate) * up, 16 lanes: the one expression of the MLP's activation, included by
// silu_mul (elementwise.cl), the down GEMV's prologue (gemv_quant.cl built with -DSILU_COLS) and
// decode_layers.cl, so the fused and the separate launches round alike, bit for bit.
// 16-wide because exp is a vector routine on PoCL.
inline float16 silu_mul16(const float16 g, const float16 u)
{
    return g / (1.0f + exp(-g)) * u;
}

// ACT[32 B : 32 B + 32] = silu(G) * U there, S = its sum: two 16-wide halves in order, each summed
// as hsum16 does (silu_mul, gemv_quant_silu's prologue, decode_layers.cl's phase 5)
#define SILU_MUL_BLOCK(S, G, U, B, ACT)                                                        \
    do {                                                                                       \
        S = 0.0f;                                                                              \
        for (int h_ = 2 * (B); h_ < 2 * (B) + 2; ++h_) {                                       \
            const float16 a_ = silu_mul16(vload16(h_, (G)), vload16(h_, (U)));                 \
            vstore16(a_, h_, (ACT));                                                           \
            const float8 s8_ = a_.lo + a_.hi;                                                  \
            const float4 s4_ = s8_.lo + s8_.hi;                                                \
            S += (s4_.x + s4_.y) + (s4_.z + s4_.w);                                            \
        }                                                                                      \
    } while (0)
