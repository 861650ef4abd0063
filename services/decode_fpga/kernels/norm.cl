// RMSNorm as Llama defines it: out = x * rsqrt(mean(x^2) + eps) * w, in fp32.
// One work-item per row: a row is a few hundred floats, already in cache.
// out_sums[r, b] = sum of out[r, 32 b : 32 b + 32] (the last block may be short): the
// block sums a Q4_1 GEMV of one row reads (gemv_quant.cl), written while out is in registers.
__kernel void rms_norm(__global const float *x, __global const float *w, __global float *out,
                       __global float *out_sums, const int n, const float eps)
{
    const int r = get_global_id(0), nb = (n + 31) / 32;
    __global const float *xr = x + (size_t)r * n;
    __global float *outr = out + (size_t)r * n;
    float4 acc = (float4)(0.0f);
    for (int i = 0; i < n / 4; ++i) { const float4 v = vload4(i, xr); acc = fma(v, v, acc); }
    const float scale = rsqrt((acc.x + acc.y + acc.z + acc.w) / n + eps);
    for (int b = 0; b < nb; ++b) {
        float4 s = (float4)(0.0f);
        for (int i = 8 * b; i < min(8 * b + 8, n / 4); ++i) {
            const float4 v = vload4(i, w) * (vload4(i, xr) * scale);
            vstore4(v, i, outr);
            s += v;
        }
        out_sums[(size_t)r * nb + b] = (s.x + s.y) + (s.z + s.w);
    }
}
