// A decode step's RoPE, KV write and attention for GPUs: one work-group of WG lanes per
// (row, query head). Same contract and arguments as attention.cl's rope_attention_decode.
//
// attention.cl gives each (row, query head) to one work-item, which walks every cached
// position alone: a CPU's shape, and 9 threads per layer on a GPU (measured on an H100 through
// NVIDIA's OpenCL: 102 us a layer at 64 positions, two thirds of a decode step). Here the lanes
// take positions in turn for the scores, then dimensions for the weighted sum of V, a tile
// of WG positions at a time (neighbouring lanes read neighbouring floats of a V row).
// Defines: HEAD_DIM, GROUP (query heads per kv head), Q_DIM, KV_DIM, WG (a power of two).

#define HALF (HEAD_DIM / 2)
#define DPL ((HEAD_DIM + WG - 1) / WG)  // dimensions per lane in the V pass

#include "wg_reduce.h"

inline float dot_local(__local const float *q, __global const float *k)
{
    float a = 0.0f;
    for (int i = 0; i < HEAD_DIM; ++i) a = fma(q[i], k[i], a);
    return a;
}

// Work-group (r, g*GROUP + j), local size (WG, 1): query head h = (kv_head0+g)*GROUP + j of row r.
// Every work-group ropes its query head and its kv head's new K into local memory (the rotation
// of attention.cl's rope()); the first of a group (j == 0) also stores K and V at pos[r]. Cached
// positions come from the cache, the new one from local memory, so no work-group reads what
// another writes. Softmax in the reference's form: exp(s - max) / sum.
__kernel void rope_attention_decode_wg(__global const float *qkv, __global const int *slots, __global const int *pos,
                                       __global const float *rope_cs, const int kv_head0, const float scale,
                                       __global float *k_chan, long k_base, const long k_stride,
                                       __global float *v_chan, long v_base, const long v_stride,
                                       const long head_stride, __global float *out, __global float *out_sums)
{
    __local float qf[HEAD_DIM], kf[HEAD_DIM], ov[HEAD_DIM], wt[WG], red[WG];
    const int r = get_group_id(0), lid = get_local_id(0);
    const int g = get_group_id(1) / GROUP, j = get_group_id(1) % GROUP;
    const int kv_head = kv_head0 + g, h = kv_head * GROUP + j, p = pos[r];
    k_base += g * head_stride;
    v_base += g * head_stride;
    __global const float *row = qkv + (size_t)r * (Q_DIM + 2 * KV_DIM);
    __global const float *q_in = row + h * HEAD_DIM, *k_in = row + Q_DIM + kv_head * HEAD_DIM;
    __global const float *v_new = row + Q_DIM + KV_DIM + kv_head * HEAD_DIM;
    __global float *K = k_chan + k_base + slots[r] * k_stride;
    __global float *V = v_chan + v_base + slots[r] * v_stride;
    __global const float *cs = rope_cs + (size_t)p * HEAD_DIM;
    for (int i = lid; i < HALF; i += WG) {
        const float c = cs[i], s = cs[HALF + i];
        float a = q_in[i], b = q_in[i + HALF];
        qf[i] = a * c - b * s;
        qf[i + HALF] = b * c + a * s;
        a = k_in[i];
        b = k_in[i + HALF];
        kf[i] = a * c - b * s;
        kf[i + HALF] = b * c + a * s;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (j == 0) {
        for (int i = lid; i < HEAD_DIM; i += WG) {
            K[(size_t)p * HEAD_DIM + i] = kf[i];
            V[(size_t)p * HEAD_DIM + i] = v_new[i];
        }
    }
    float s_new = 0.0f;
    for (int i = 0; i < HEAD_DIM; ++i) s_new = fma(qf[i], kf[i], s_new);
    s_new *= scale;

    float m = s_new;
    for (int t = lid; t < p; t += WG) m = fmax(m, dot_local(qf, K + (size_t)t * HEAD_DIM) * scale);
    m = reduce_max(red, lid, m);

    float acc[DPL], wsum = 0.0f;
    for (int k = 0; k < DPL; ++k) acc[k] = 0.0f;
    for (int t0 = 0; t0 < p; t0 += WG) {
        const int t = t0 + lid;
        const float w = t < p ? exp(dot_local(qf, K + (size_t)t * HEAD_DIM) * scale - m) : 0.0f;
        wsum += w;
        wt[lid] = w;
        barrier(CLK_LOCAL_MEM_FENCE);
        const int nt = min(WG, p - t0);
        for (int e = 0; e < nt; ++e) {
            const float we = wt[e];
            __global const float *vr = V + (size_t)(t0 + e) * HEAD_DIM;
            for (int k = 0; k < DPL; ++k) {
                const int d = lid + k * WG;
                if (d < HEAD_DIM) acc[k] = fma(we, vr[d], acc[k]);
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);  // wt is rewritten by the next tile
    }
    const float w_new = exp(s_new - m);
    const float inv = 1.0f / (reduce_sum(red, lid, wsum) + w_new);
    __global float *o = out + (size_t)r * Q_DIM + h * HEAD_DIM;
    for (int k = 0; k < DPL; ++k) {
        const int d = lid + k * WG;
        if (d < HEAD_DIM) {
            const float v = fma(w_new, v_new[d], acc[k]) * inv;
            o[d] = v;
            ov[d] = v;
        }
    }
#if HEAD_DIM % 32 == 0
    // the head's 32-blocks' sums, as attention.cl writes them (a Q4_1 GEMV of one row reads them)
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int b = lid; b < HEAD_DIM / 32; b += WG) {
        float s = 0.0f;
        for (int i = 32 * b; i < 32 * b + 32; ++i) s += ov[i];
        out_sums[(size_t)r * (Q_DIM / 32) + h * (HEAD_DIM / 32) + b] = s;
    }
#endif
}
