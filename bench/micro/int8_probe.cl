// A probe for issue 55's opt-in int8-activation path, not an engine kernel: a Q4_1 matrix in
// gemv_quant.cl's layout (fp32 d, fp16 m, 16 nibble bytes a block) times one row of x quantized to
// int8 per block of 32 (xq, with scale dx), one work-item per output row. A block's 32 products
// come from AVX2's vpmaddubsw (u8 nibbles x s8 activations, pairs summed to int16) and vpmaddwd
// (pairs of those to int32), named through clang's builtins: LLVM 15 (PoCL 3.1 here) turned the
// same arithmetic written in OpenCL C vectors into multiplies and shuffles, slower than the fp32
// kernel. Then float(sum) * d_w d_x per block, and the minimums through x's fp32 block sums.
// Without AVX2 (another device) the kernel writes NaN, which the benchmark reports.
#ifdef __AVX2__
typedef char c32 __attribute__((ext_vector_type(32)));
typedef short s16v __attribute__((ext_vector_type(16)));
typedef int i8v __attribute__((ext_vector_type(8)));
#endif

__kernel void gemv_q4_1_int8(__global const float *d, __global const half *m, __global const uchar *q,
                             __global const char *xq, __global const float *dx, __global const float *xsum,
                             __global float *y, const int cols)
{
    const int o = get_global_id(0);
#ifdef __AVX2__
    const int nb = cols / 32, nbp = (nb + 3) & ~3;
    __global const float *drow = d + (size_t)o * nbp;
    __global const half *mrow = m + (size_t)o * nbp;
    __global const uchar *qrow = q + (size_t)o * nb * 16;
    float8 a0 = (float8)(0.0f), a1 = a0;
    const s16v ones = (s16v)(1);
    for (int b = 0; b < nb; ++b) {
        const uchar16 qb = vload16(b, qrow);
        c32 w;  // weights 0..15 (low nibbles), then 16..31 (high), as x's block holds them
        w.s0123456789abcdef = as_char16(qb & (uchar16)(0x0F));
        w.hi = as_char16(qb >> (uchar16)(4));
        const i8v s = __builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256(w, *(__global const c32 *)(xq + 32 * b)),
                                                ones);
        const float8 sf = convert_float8(as_int8(s));
        if (b & 1)
            a1 = fma(sf, (float8)(drow[b] * dx[b]), a1);
        else
            a0 = fma(sf, (float8)(drow[b] * dx[b]), a0);
    }
    const float8 a = a0 + a1;
    const float4 a4 = a.lo + a.hi;
    float4 ms = (float4)(0.0f);
    for (int g = 0; g < nb / 4; ++g) ms = fma(vload_half4(g, mrow), vload4(g, xsum), ms);
    y[o] = ((a4.x + a4.y) + (a4.z + a4.w)) + ((ms.x + ms.y) + (ms.z + ms.w));
#else
    y[o] = NAN;
#endif
}
