// Small element-wise and reduction kernels of a decode step.

#include "silu.h"

// act[r, i] = silu(gu[r, i]) * gu[r, FF + i]   gu: [rows, 2 FF] (gate | up), act: [rows, FF]
// Work-item (r, b) makes act[r, 32 b : 32 b + 32] (the last block may be short) and its sum,
// act_sums[r, b]: the block sums a Q4_1 GEMV of one row reads (gemv_quant.cl).
__kernel void silu_mul(__global const float *gu, __global float *act, __global float *act_sums, const int ff)
{
    const int r = get_global_id(0), b = get_global_id(1), nb = (ff + 31) / 32;
    __global const float *g = gu + (size_t)r * 2 * ff, *u = g + ff;
    float s = 0.0f;
    if (32 * b + 32 <= ff) {  // a whole block: 16-wide (exp is a vector routine on PoCL)
        SILU_MUL_BLOCK(s, g, u, b, act + (size_t)r * ff);
    } else {
        for (int i = 32 * b; i < ff; ++i) {
            const float a = g[i] / (1.0f + exp(-g[i])) * u[i];
            act[(size_t)r * ff + i] = a;
            s += a;
        }
    }
    act_sums[(size_t)r * nb + b] = s;
}

// tokens[r] = the first index of the largest logits[r, :], and pos[r] += 1: a greedy decode
// step leaves its rows' next tokens and positions where the next step reads them, so that step
// uploads nothing (its three host-to-device copies took ~0.3 ms of host time on PoCL before the
// step could start). The host reads the picks back from tokens. One work-group of ARGMAX_WG per row.
// Each work-item scans a contiguous chunk (first maximum kept), then work-item 0 scans the
// ARGMAX_WG candidates: one barrier, where a halving tree took eight (on PoCL each barrier
// splits the work-group loop; the tree made this launch ~95 us of a decode step).
__kernel void argmax_rows(__global const float *logits, const int vocab, __global int *tokens, __global int *pos)
{
    __local float best_v[ARGMAX_WG];
    __local int best_i[ARGMAX_WG];
    const int r = get_group_id(0), lid = get_local_id(0);
    const int chunk = (vocab + 8 * ARGMAX_WG - 1) / (8 * ARGMAX_WG) * 8;  // a multiple of 8
    __global const float *row = logits + (size_t)r * vocab;
    const int start = min(lid * chunk, vocab), end = min(start + chunk, vocab);
    // 8 lanes, each the first maximum of its stride-8 subsequence; then the lanes in index order
    float8 lv = (float8)(-INFINITY);
    int8 li = (int8)(vocab);
    int i = start;
    for (; i + 8 <= end; i += 8) {
        const float8 v = vload8(0, row + i);
        const int8 better = isgreater(v, lv);
        lv = select(lv, v, better);
        li = select(li, (int8)(i) + (int8)(0, 1, 2, 3, 4, 5, 6, 7), better);
    }
    float bv = -INFINITY;
    int bi = vocab;
    const float lvs[8] = {lv.s0, lv.s1, lv.s2, lv.s3, lv.s4, lv.s5, lv.s6, lv.s7};
    const int lis[8] = {li.s0, li.s1, li.s2, li.s3, li.s4, li.s5, li.s6, li.s7};
    for (int k = 0; k < 8; ++k) {
        if (lvs[k] > bv || (lvs[k] == bv && lis[k] < bi)) { bv = lvs[k]; bi = lis[k]; }
    }
    for (; i < end; ++i) {  // the tail of the last chunk
        const float v = row[i];
        if (v > bv) { bv = v; bi = i; }
    }
    best_v[lid] = bv;
    best_i[lid] = bi;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid == 0) {
        // chunks are in index order, so a strictly larger value is the only reason to move on
        for (int k = 1; k < ARGMAX_WG; ++k) {
            if (best_v[k] > bv) { bv = best_v[k]; bi = best_i[k]; }
        }
        tokens[r] = bi;
        pos[r] += 1;
    }
}

// a[i] = 0: decode_layers.cl's counters, before every step that runs it
__kernel void clear_ints(__global int *a)
{
    a[get_global_id(0)] = 0;
}

// dst[i, :] = src[rows[i], :] for i < the global size: a step's sampling rows gathered into
// consecutive rows, so the final norm and the LM head run over them alone
__kernel void gather_rows(__global const float *src, __global const int *rows, __global float *dst, const int cols)
{
    const int i = get_global_id(0);
    __global const float *s = src + (size_t)rows[i] * cols;
    __global float *t = dst + (size_t)i * cols;
    for (int c = 0; c < cols / 4; ++c) vstore4(vload4(c, s), c, t);
}
