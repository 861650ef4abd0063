// RMSNorm as Llama defines it: out = x * rsqrt(mean(x^2) + eps) * w, in fp32.
// One work-item per row: a row is a few hundred floats, already in cache.
__kernel void rms_norm(__global const float *x, __global const float *w, __global float *out,
                       const int n, const float eps)
{
    const int r = get_global_id(0);
    __global const float *xr = x + (size_t)r * n;
    float4 acc = (float4)(0.0f);
    for (int i = 0; i < n / 4; ++i) { const float4 v = vload4(i, xr); acc = fma(v, v, acc); }
    const float scale = rsqrt((acc.x + acc.y + acc.z + acc.w) / n + eps);
    for (int i = 0; i < n / 4; ++i) vstore4(vload4(i, w) * (vload4(i, xr) * scale), i, out + (size_t)r * n);
}
