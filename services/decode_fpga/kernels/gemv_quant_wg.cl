// GEMV straight from GGUF blocks for GPUs: one work-group of WG lanes per output element.
// QFMT: the format's code (quant_blocks.h); the device layout is gemv_quant.cl's (quant_gemv.py).
//
// gemv_quant.cl gives each output row to one work-item, which is what a CPU wants (a row's
// blocks stream through one core's caches) and what starves a GPU: a 576-row matrix is 576
// threads, each walking its row alone (measured on an H100 through NVIDIA's OpenCL: 97 us for
// the 576x1536 Q4_1 down projection, 0.9 GB/s). Here the lanes of a work-group split a row into
// half-blocks of 16 weights (neighbouring lanes read neighbouring bytes), dequantize them to
// gguf's values exactly as gemv_quant.cl does, and add their partial sums in local memory.
// No block sums of x are read: each lane dequantizes d*q + m itself.

// the formats' sizes and row addressing (its one-row dot is not used here)
#define XAS __global
#include "quant_blocks.h"

// the dequantized weight e (0..31) of a 5- or 6-bit block (quants QB, its scale D for weight e,
// minimum M), gguf's value (quant_blocks.h)
inline float kq_weight(__global const uchar *qb, const float d, const float m, const int e)
{
#if QFMT == 62
    const int j = e & 15;  // weight 16 + j: its low 2 bits in byte j, high 4 in the ulong after
    const int v = e < 16 ? (qb[j] & 0x3F)
                         : ((qb[j] >> 6) | (((qb[16 + 4 * (j & 1) + (j >> 2)] >> (4 * ((j >> 1) & 1))) & 15) << 2));
#else
    int v = e < 16 ? (qb[e] & 0x0F) : (qb[e - 16] >> 4);
#if QFMT == 50 || QFMT == 51 || QFMT == 52
    v |= (int)((*(__global const uint *)(qb + 16) >> e) & 1u) << 4;
#endif
#endif
#if QFMT == 50
    return d * (float)(v - 16);
#elif QFMT == 62
    return d * (float)(v - 32);
#else
    return d * (float)v + m;
#endif
}

// XAT(c): element c of the GEMV's input: x, or in gemv_quant_norm_wg's build (-DNORM_COLS)
// RMSNorm(x) computed on the fly, with the expression of norm.cl's rms_norm
#ifdef NORM_COLS
#define XAT(c) (norm_w[(c)] * (x[(c)] * scale))
#else
#define XAT(c) (x[(c)])
#endif

// ACC += the 16 weights of half-block U of a row (block U / 2, half U % 2) times their inputs
#define HALF_DOT(ACC, D, M, Q, U)                                                              \
    do {                                                                                       \
        const int b_ = (U) >> 1, h_ = (U) & 1;                                                 \
        const float d_ = HALF_SCALE((D), (M), b_, h_);                                         \
        const int c0_ = 32 * b_;                                                               \
        if (QBYTES != 16 && QFMT != 80) { /* 5 and 6 bits: weight by weight */                 \
            const float m_ = HAS_MINS ? MIN_AT((M), b_, (D)) : 0.0f;                           \
            for (int j_ = 0; j_ < 16; ++j_)                                                    \
                ACC += kq_weight((Q) + QBYTES * b_, d_, m_, 16 * h_ + j_) * XAT(c0_ + 16 * h_ + j_); \
        } else if (QFMT == 80) {                                                               \
            __global const char *qc_ = (__global const char *)(Q) + QBYTES * b_ + 16 * h_;     \
            for (int j_ = 0; j_ < 16; ++j_) ACC += (d_ * (float)qc_[j_]) * XAT(c0_ + 16 * h_ + j_); \
        } else {                                                                               \
            const float m_ = HAS_MINS ? MIN_AT((M), b_, (D)) : 0.0f;                           \
            __global const uchar *qb_ = (Q) + QBYTES * b_ + 8 * h_;                            \
            for (int j_ = 0; j_ < 8; ++j_) {                                                   \
                const int lo_ = qb_[j_] & 0x0F, hi_ = qb_[j_] >> 4;                            \
                const float wl_ = (QFMT == 40) ? d_ * (float)(lo_ - 8) : d_ * (float)lo_ + m_;  \
                const float wh_ = (QFMT == 40) ? d_ * (float)(hi_ - 8) : d_ * (float)hi_ + m_;  \
                ACC += wl_ * XAT(c0_ + 8 * h_ + j_);                                           \
                ACC += wh_ * XAT(c0_ + 16 + 8 * h_ + j_);                                      \
            }                                                                                  \
        }                                                                                      \
    } while (0)

#include "wg_reduce.h"

// ACC = sum_c W[O, c] * XAT(c) over a row of NB blocks, the lanes taking half-blocks in turn and
// reducing through RED (WG floats of local memory); every lane gets the sum
#define ROW_SUM_WG(ACC, O, NB, RED)                                                            \
    do {                                                                                       \
        const int nbp_ = ((NB) + 3) & ~3;                                                      \
        __global const float *drow_ = DROW_AT(d, (O), nbp_);                                   \
        __global const half *mrow_ = MROW_AT(m, (O), nbp_);                                    \
        __global const uchar *qrow_ = q + (size_t)(O) * (NB) * QBYTES;                         \
        float acc_ = 0.0f;                                                                     \
        for (int u_ = lid; u_ < 2 * (NB); u_ += WG) HALF_DOT(acc_, drow_, mrow_, qrow_, u_);   \
        ACC = reduce_sum((RED), lid, acc_);                                                    \
    } while (0)

#ifndef NORM_COLS
// y[r, o] (+)= sum_c W[o, c] * x[r, c]; work-group (o, r), local size (WG, 1)
__kernel void gemv_quant_wg(__global const float *d, __global const half *m, __global const uchar *q,
                            __global const float *x_all, __global float *y, const int cols,
                            const int out_rows, const int accumulate, const int y_offset,
                            const int y_stride)
{
    y += y_offset;
    __local float part[WG];
    const int o = get_group_id(0), r = get_global_id(1), lid = get_local_id(0);
    __global const float *x = x_all + (size_t)r * cols;
    float sum;
    ROW_SUM_WG(sum, o, cols / 32, part);
    if (lid == 0) {
        const size_t k = (size_t)r * y_stride + o;
        y[k] = accumulate ? y[k] + sum : sum;
    }
}
#else
// One row: y[o] (+)= sum_c W[o, c] * rms_norm(x, norm_w)[c], x: [NORM_COLS]; every work-group
// reduces the sum of squares itself, so the norm needs no launch of its own
__kernel void gemv_quant_norm_wg(__global const float *d, __global const half *m, __global const uchar *q,
                                 __global const float *x, __global const float *norm_w, const float eps,
                                 __global float *y, const int out_rows, const int accumulate,
                                 const int y_offset)
{
    y += y_offset;
    __local float part[WG];
    const int o = get_group_id(0), lid = get_local_id(0);
    float ss = 0.0f;
    for (int c = lid; c < NORM_COLS; c += WG) ss = fma(x[c], x[c], ss);
    const float scale = rsqrt(reduce_sum(part, lid, ss) / NORM_COLS + eps);
    float sum;
    ROW_SUM_WG(sum, o, NORM_COLS / 32, part);
    if (lid == 0) y[o] = accumulate ? y[o] + sum : sum;
}
#endif
