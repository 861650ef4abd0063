// Matrix-vector products over dense weights, one work-item per output row.
// WFMT selects the storage: 0 = fp32, 1 = fp16 (vload_half4: scalar and 2-wide
// half loads are emulated in software on PoCL; 4-wide use the hardware).
// Accumulation is always fp32.
#if WFMT == 1
typedef half wtype;
#define LOADW(i, p) vload_half4((i), (p))
#else
typedef float wtype;
#define LOADW(i, p) vload4((i), (p))
#endif

// y[r, o] (+)= sum_c W[o, c] * x[r, c]   W: [out_rows, cols], x: [n_rows, cols], y: [n_rows, out_rows]
// cols % 16 == 0 (checked by the launcher).
__kernel void gemv(__global const wtype *W, __global const float *x, __global float *y,
                   const int cols, const int out_rows, const int n_rows, const int accumulate)
{
    const int o = get_global_id(0);
    if (o >= out_rows) return;
    __global const wtype *w = W + (size_t)o * cols;
    const int c4 = cols / 4;
    if (n_rows == 1) {
        // four independent accumulators keep the FMA pipes busy (about 2x on PoCL)
        float4 a0 = (float4)(0.0f), a1 = (float4)(0.0f), a2 = (float4)(0.0f), a3 = (float4)(0.0f);
        for (int i = 0; i < c4; i += 4) {
            a0 = fma(LOADW(i, w), vload4(i, x), a0);
            a1 = fma(LOADW(i + 1, w), vload4(i + 1, x), a1);
            a2 = fma(LOADW(i + 2, w), vload4(i + 2, x), a2);
            a3 = fma(LOADW(i + 3, w), vload4(i + 3, x), a3);
        }
        const float4 s = (a0 + a1) + (a2 + a3);
        const float acc = (s.x + s.y) + (s.z + s.w);
        y[o] = accumulate ? y[o] + acc : acc;
        return;
    }
    // several rows, four at a time: each weight vector is loaded once per pass and
    // used four times; fixed-size register tiles (a runtime-sized array spills).
    for (int r0 = 0; r0 < n_rows; r0 += 4) {
        // rows past n_rows re-read the last row (harmless) and are not stored
        __global const float *x0 = x + (size_t)min(r0, n_rows - 1) * cols;
        __global const float *x1 = x + (size_t)min(r0 + 1, n_rows - 1) * cols;
        __global const float *x2 = x + (size_t)min(r0 + 2, n_rows - 1) * cols;
        __global const float *x3 = x + (size_t)min(r0 + 3, n_rows - 1) * cols;
        float4 a0 = (float4)(0.0f), a1 = (float4)(0.0f), a2 = (float4)(0.0f), a3 = (float4)(0.0f);
        for (int i = 0; i < c4; ++i) {
            const float4 wv = LOADW(i, w);
            a0 = fma(wv, vload4(i, x0), a0);
            a1 = fma(wv, vload4(i, x1), a1);
            a2 = fma(wv, vload4(i, x2), a2);
            a3 = fma(wv, vload4(i, x3), a3);
        }
        const float v[4] = {(a0.x + a0.y) + (a0.z + a0.w), (a1.x + a1.y) + (a1.z + a1.w),
                            (a2.x + a2.y) + (a2.z + a2.w), (a3.x + a3.y) + (a3.z + a3.w)};
        for (int r = 0; r < 4 && r0 + r < n_rows; ++r) {
            const size_t k = (size_t)(r0 + r) * out_rows + o;
            y[k] = accumulate ? y[k] + v[r] : v[r];
        }
    }
}

// y[r, o] (+)= sum_c W[o, c] * x[r, c] for r < n_rows[0], every row with the one-row loop above
// (four accumulators): a row's result never depends on how many rows run beside it (batch
// invariance), where gemv's four-row passes round differently. The row count is read from the
// device, so a launch bound once serves a step of any size.
__kernel void gemv_rows(__global const wtype *W, __global const float *x, __global float *y,
                        const int cols, const int out_rows, __global const int *n_rows, const int accumulate)
{
    const int o = get_global_id(0);
    if (o >= out_rows) return;
    __global const wtype *w = W + (size_t)o * cols;
    const int c4 = cols / 4, n = n_rows[0];
    for (int r = 0; r < n; ++r) {
        __global const float *xr = x + (size_t)r * cols;
        float4 a0 = (float4)(0.0f), a1 = (float4)(0.0f), a2 = (float4)(0.0f), a3 = (float4)(0.0f);
        for (int i = 0; i < c4; i += 4) {
            a0 = fma(LOADW(i, w), vload4(i, xr), a0);
            a1 = fma(LOADW(i + 1, w), vload4(i + 1, xr), a1);
            a2 = fma(LOADW(i + 2, w), vload4(i + 2, xr), a2);
            a3 = fma(LOADW(i + 3, w), vload4(i + 3, xr), a3);
        }
        const float4 s = (a0 + a1) + (a2 + a3);
        const float acc = (s.x + s.y) + (s.z + s.w);
        const size_t k = (size_t)r * out_rows + o;
        y[k] = accumulate ? y[k] + acc : acc;
    }
}

// x[r, :] = E[tokens[r], :]   E: [vocab, cols] in the weight storage format
__kernel void embed_rows(__global const wtype *E, __global const int *tokens, __global float *x, const int cols)
{
    const int r = get_global_id(0);
    __global const wtype *e = E + (size_t)tokens[r] * cols;
    for (int i = 0; i < cols / 4; ++i) vstore4(LOADW(i, e), i, x + (size_t)r * cols);
}
