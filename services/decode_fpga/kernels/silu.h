// act = silu(gate) * up, 16 lanes: the one expression of the MLP's activation, included by
// silu_mul (elementwise.cl) and by the down GEMV's prologue (gemv_quant.cl built with
// -DSILU_COLS), so the fused and the separate launches round alike, bit for bit.
// 16-wide because exp is a vector routine on PoCL.
inline float16 silu_mul16(const float16 g, const float16 u)
{
    return g / (1.0f + exp(-g)) * u;
}
