// GEMV straight from GGUF blocks: dequantized in registers, accumulated in fp32,
// one work-item per output row. QFMT: 40 = Q4_0, 41 = Q4_1, 80 = Q8_0.
//
// Device layout of a [rows, cols] matrix, nb = cols / 32 blocks per row (quant_gemv.py
// repacks the blocks; every value stays the block's own):
//   d: half [rows][nbp]   the blocks' scales, nbp = nb rounded up to 4 (zero padded)
//   m: half [rows][nbp]   the blocks' minimums (Q4_1 only)
//   q: Q4: uchar [rows][nb][16]  byte j = weight j (low nibble) | weight j+16 (high nibble)
//      Q8: char  [rows][nb][32]
// Why this layout, measured on PoCL: scales apart from quants so no load straddles
// both (overlapping loads made the compiler shuffle bytes), and 4 scales per
// vload_half4 (scalar and 2-wide half loads are emulated in software there).
//
// Weight values: Q4_0 d*(q-8), Q4_1 d*q+m, Q8_0 d*q, as gguf.quants.dequantize, bit for bit
// even where the compiler fuses d*q+m into an fma: d (11-bit mantissa) times q (at most 8
// bits) is exact in fp32, so the fused and the separately rounded results are the same.

#if QFMT == 80
#define QBYTES 32
#else
#define QBYTES 16
#endif

// the 32 weights of block b of a row: w0 = weights 0..15, w1 = weights 16..31
inline void dequant_block(__global const uchar *q, const int b, const float d, const float m,
                          float16 *w0, float16 *w1)
{
#if QFMT == 80
    __global const char *qc = (__global const char *)q;
    *w0 = convert_float16(vload16(2 * b, qc)) * d;
    *w1 = convert_float16(vload16(2 * b + 1, qc)) * d;
#else
    const uint16 qi = convert_uint16(vload16(b, q));
    const float16 lo = convert_float16(qi & (uint16)(0x0F));
    const float16 hi = convert_float16(qi >> (uint16)(4));
#if QFMT == 40
    *w0 = (lo - 8.0f) * d;
    *w1 = (hi - 8.0f) * d;
#else
    *w0 = lo * d + m;
    *w1 = hi * d + m;
#endif
#endif
}

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

#if QFMT == 41
#define LOAD_MINS(g) vload_half4((g), mrow)
#else
#define LOAD_MINS(g) ((float4)(0.0f))
#endif

// y[r, o] (+)= sum_c W[o, c] * x[r, c]   x: [n_rows, cols], y: [n_rows, out_rows], cols % 32 == 0
__kernel void gemv_quant(__global const half *d, __global const half *m, __global const uchar *q,
                         __global const float *x, __global float *y,
                         const int cols, const int out_rows, const int n_rows, const int accumulate)
{
    const int o = get_global_id(0);
    if (o >= out_rows) return;
    const int nb = cols / 32, nbp = (nb + 3) & ~3, ng = nb / 4;
    __global const half *drow = d + (size_t)o * nbp;
    __global const half *mrow = m + (size_t)o * nbp;
    __global const uchar *qrow = q + (size_t)o * nb * QBYTES;
    float16 w0, w1;

    if (n_rows == 1) {
        // four independent accumulators: two blocks in flight at a time
        float16 a0 = (float16)(0.0f), a1 = a0, a2 = a0, a3 = a0;
        for (int g = 0; g < ng; ++g) {
            const float4 d4 = vload_half4(g, drow), m4 = LOAD_MINS(g);
            const int b = 4 * g;
            dequant_block(qrow, b, d4.x, m4.x, &w0, &w1);
            a0 = fma(w0, vload16(2 * b, x), a0);
            a1 = fma(w1, vload16(2 * b + 1, x), a1);
            dequant_block(qrow, b + 1, d4.y, m4.y, &w0, &w1);
            a2 = fma(w0, vload16(2 * b + 2, x), a2);
            a3 = fma(w1, vload16(2 * b + 3, x), a3);
            dequant_block(qrow, b + 2, d4.z, m4.z, &w0, &w1);
            a0 = fma(w0, vload16(2 * b + 4, x), a0);
            a1 = fma(w1, vload16(2 * b + 5, x), a1);
            dequant_block(qrow, b + 3, d4.w, m4.w, &w0, &w1);
            a2 = fma(w0, vload16(2 * b + 6, x), a2);
            a3 = fma(w1, vload16(2 * b + 7, x), a3);
        }
        int b0 = 4 * ng;
        if (nb - b0 >= 2) {  // a pair left (576 columns: 18 blocks): no lane selects
            const float4 d4 = vload_half4(ng, drow), m4 = LOAD_MINS(ng);
            dequant_block(qrow, b0, d4.x, m4.x, &w0, &w1);
            a0 = fma(w0, vload16(2 * b0, x), a0);
            a1 = fma(w1, vload16(2 * b0 + 1, x), a1);
            dequant_block(qrow, b0 + 1, d4.y, m4.y, &w0, &w1);
            a2 = fma(w0, vload16(2 * b0 + 2, x), a2);
            a3 = fma(w1, vload16(2 * b0 + 3, x), a3);
            b0 += 2;
        }
        for (int b = b0; b < nb; ++b) {  // the last block when nb is odd (scales are padded to 4)
            const float4 d4 = vload_half4(ng, drow), m4 = LOAD_MINS(ng);
            dequant_block(qrow, b, pick4(d4, b & 3), pick4(m4, b & 3), &w0, &w1);
            a0 = fma(w0, vload16(2 * b, x), a0);
            a1 = fma(w1, vload16(2 * b + 1, x), a1);
        }
        const float acc = hsum16((a0 + a1) + (a2 + a3));
        y[o] = accumulate ? y[o] + acc : acc;
        return;
    }

    // several rows of x, eight (then four) at a time: each block is dequantized once per pass
    int r0 = 0;
    for (; r0 + 8 <= n_rows; r0 += 8) {
        __global const float *xr = x + (size_t)r0 * cols;
        float16 c0 = (float16)(0.0f), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
        for (int b = 0; b < nb; ++b) {
            const float4 d4 = vload_half4(b >> 2, drow), m4 = LOAD_MINS(b >> 2);
            dequant_block(qrow, b, pick4(d4, b & 3), pick4(m4, b & 3), &w0, &w1);
#define ROW(c, r) c = fma(w1, vload16(2 * b + 1, xr + (r) * cols), fma(w0, vload16(2 * b, xr + (r) * cols), c))
            ROW(c0, 0); ROW(c1, 1); ROW(c2, 2); ROW(c3, 3); ROW(c4, 4); ROW(c5, 5); ROW(c6, 6); ROW(c7, 7);
#undef ROW
        }
        const float v[8] = {hsum16(c0), hsum16(c1), hsum16(c2), hsum16(c3),
                            hsum16(c4), hsum16(c5), hsum16(c6), hsum16(c7)};
        for (int r = 0; r < 8; ++r) {
            const size_t k = (size_t)(r0 + r) * out_rows + o;
            y[k] = accumulate ? y[k] + v[r] : v[r];
        }
    }
    for (; r0 < n_rows; r0 += 4) {
        // rows past n_rows re-read the last row (harmless) and are not stored
        __global const float *x0 = x + (size_t)min(r0, n_rows - 1) * cols;
        __global const float *x1 = x + (size_t)min(r0 + 1, n_rows - 1) * cols;
        __global const float *x2 = x + (size_t)min(r0 + 2, n_rows - 1) * cols;
        __global const float *x3 = x + (size_t)min(r0 + 3, n_rows - 1) * cols;
        float16 c0 = (float16)(0.0f), c1 = c0, c2 = c0, c3 = c0;
        for (int b = 0; b < nb; ++b) {
            const float4 d4 = vload_half4(b >> 2, drow), m4 = LOAD_MINS(b >> 2);
            dequant_block(qrow, b, pick4(d4, b & 3), pick4(m4, b & 3), &w0, &w1);
            c0 = fma(w1, vload16(2 * b + 1, x0), fma(w0, vload16(2 * b, x0), c0));
            c1 = fma(w1, vload16(2 * b + 1, x1), fma(w0, vload16(2 * b, x1), c1));
            c2 = fma(w1, vload16(2 * b + 1, x2), fma(w0, vload16(2 * b, x2), c2));
            c3 = fma(w1, vload16(2 * b + 1, x3), fma(w0, vload16(2 * b, x3), c3));
        }
        const float v[4] = {hsum16(c0), hsum16(c1), hsum16(c2), hsum16(c3)};
        for (int r = 0; r < 4 && r0 + r < n_rows; ++r) {
            const size_t k = (size_t)(r0 + r) * out_rows + o;
            y[k] = accumulate ? y[k] + v[r] : v[r];
        }
    }
}

// x[r, :] = E[tokens[r], :] dequantized (the embedding lookup from the blocks), one work-item per row
__kernel void embed_rows(__global const half *d, __global const half *m, __global const uchar *q,
                         __global const int *tokens, __global float *x, const int cols)
{
    const int r = get_global_id(0);
    const int nb = cols / 32, nbp = (nb + 3) & ~3;
    const size_t row = (size_t)tokens[r];
    __global const half *drow = d + row * nbp;
    __global const half *mrow = m + row * nbp;
    __global const uchar *qrow = q + row * nb * QBYTES;
    __global float *out = x + (size_t)r * cols;
    float16 w0, w1;
    for (int b = 0; b < nb; ++b) {
        const float4 d4 = vload_half4(b >> 2, drow), m4 = LOAD_MINS(b >> 2);
        dequant_block(qrow, b, pick4(d4, b & 3), pick4(m4, b & 3), &w0, &w1);
        vstore16(w0, 2 * b, out);
        vstore16(w1, 2 * b + 1, out);
    }
}
