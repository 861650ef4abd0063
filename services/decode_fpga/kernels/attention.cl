// RoPE, the KV-cache write and attention for one (layer, kv_head) group.
//
// Rows are (slot, position) pairs: a prefill is many rows of one slot, a batched
// decode one row per sequence. Row r attends to positions [0, pos[r]] of its slot,
// which makes prefill causal and decode a plain lookup with the same code.
// A plane is one (layer, k|v, kv_head) of a slot: [max_context][HEAD_DIM] floats at
// plane_base + slot * slot_stride in its channel buffer (see kv_channels.py).
// One launch covers the kv heads kv_head0, kv_head0 + 1, ... along global dimension 1
// when their planes share a buffer at a constant head_stride (one channel); with
// several channels the host launches once per head (head_stride unused).
// Defines: HEAD_DIM, GROUP (query heads per kv head), Q_DIM, KV_DIM.

#include "attention_decode.h"

// The RoPE angles' cosines and sines of every position, computed once at start-up:
// rope_cs[pos][0:HALF] = cos, rope_cs[pos][HALF:HEAD_DIM] = sin. On PoCL cos/sin are
// software routines (~20 us a launch when each decode step recomputed them); the
// expression is the one the per-step code used, so the values are unchanged.
__kernel void rope_table(__global const float *inv_freq, __global float *rope_cs)
{
    const int pos = get_global_id(0), i = get_global_id(1);
    const float angle = (float)pos * inv_freq[i];
    rope_cs[(size_t)pos * HEAD_DIM + i] = cos(angle);
    rope_cs[(size_t)pos * HEAD_DIM + HALF + i] = sin(angle);
}

// The same for a head vector in global memory (rope_store_kv ropes the qkv rows in place).
inline void rope_global(__global float *v, const int pos, __global const float *rope_cs)
{
    float t[HEAD_DIM];
    for (int i = 0; i < HEAD_DIM; ++i) t[i] = v[i];
    rope(t, pos, rope_cs);
    for (int i = 0; i < HEAD_DIM; ++i) v[i] = t[i];
}

// qkv: [rows, Q_DIM + 2 KV_DIM]. Work-item (r, g*(GROUP+1) + j) serves kv head
// kv_head0 + g: j == 0 ropes its K and stores K and V into the cache; j in 1..GROUP
// ropes query head (kv_head*GROUP + j-1).
__kernel void rope_store_kv(__global float *qkv, __global const int *slots, __global const int *pos,
                            __global const float *rope_cs, const int kv_head0,
                            __global float *k_chan, long k_base, const long k_stride,
                            __global float *v_chan, long v_base, const long v_stride, const long head_stride)
{
    const int r = get_global_id(0), g = get_global_id(1) / (GROUP + 1), j = get_global_id(1) % (GROUP + 1);
    const int kv_head = kv_head0 + g;
    k_base += g * head_stride;
    v_base += g * head_stride;
    __global float *row = qkv + (size_t)r * (Q_DIM + 2 * KV_DIM);
    if (j > 0) {
        rope_global(row + (kv_head * GROUP + j - 1) * HEAD_DIM, pos[r], rope_cs);
        return;
    }
    __global float *k = row + Q_DIM + kv_head * HEAD_DIM;
    __global const float *v = row + Q_DIM + KV_DIM + kv_head * HEAD_DIM;
    rope_global(k, pos[r], rope_cs);
    __global float *kd = k_chan + k_base + slots[r] * k_stride + (long)pos[r] * HEAD_DIM;
    __global float *vd = v_chan + v_base + slots[r] * v_stride + (long)pos[r] * HEAD_DIM;
    for (int i = 0; i < HEAD_DIM / 4; ++i) {
        vstore4(vload4(i, k), i, kd);
        vstore4(vload4(i, v), i, vd);
    }
}

// Work-item (r, g*GROUP + j): query head h = (kv_head0+g)*GROUP + j of row r; out: [rows, Q_DIM].
// When HEAD_DIM % 32 == 0 it also writes out_sums[r, :] of its head's 32-blocks (out_sums:
// [rows, Q_DIM / 32]), which a Q4_1 GEMV of one row reads (gemv_quant.cl); otherwise the
// engine launches block_sums.
// Two passes (max, then exp-sum and weighted V) keep the softmax in the same form as
// the reference: exp(s - max) / sum.
__kernel void attention(__global const float *qkv, __global const int *slots, __global const int *pos,
                        const int kv_head0, const float scale,
                        __global const float *k_chan, long k_base, const long k_stride,
                        __global const float *v_chan, long v_base, const long v_stride, const long head_stride,
                        __global float *out, __global float *out_sums)
{
    const int r = get_global_id(0), g = get_global_id(1) / GROUP, j = get_global_id(1) % GROUP;
    const int h = (kv_head0 + g) * GROUP + j;
    k_base += g * head_stride;
    v_base += g * head_stride;
    __global const float *q = qkv + (size_t)r * (Q_DIM + 2 * KV_DIM) + h * HEAD_DIM;
    __global const float *K = k_chan + k_base + slots[r] * k_stride;
    __global const float *V = v_chan + v_base + slots[r] * v_stride;
    const int n = pos[r] + 1;
    hvec qv[NV];
    for (int i = 0; i < NV; ++i) qv[i] = VLOADH(i, q);
    const float m = max_score(qv, K, n, scale, -INFINITY);
    hvec acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = (hvec)(0.0f);
    store_head(acc, weigh_values(qv, K, V, n, scale, m, acc), r, h, out, out_sums);
}

// A decode step's rope_store_kv and attention in one launch (one command per layer instead of
// two; PoCL charges ~5 us per command). Every row is a different sequence, at position pos[r].
// Work-items as in attention (attend_decode, attention_decode.h). Prefill rows of one sequence
// read each other's K and V, so prefill keeps the two launches.
__kernel void rope_attention_decode(__global const float *qkv, __global const int *slots, __global const int *pos,
                                    __global const float *rope_cs, const int kv_head0, const float scale,
                                    __global float *k_chan, long k_base, const long k_stride,
                                    __global float *v_chan, long v_base, const long v_stride,
                                    const long head_stride, __global float *out, __global float *out_sums)
{
    const int r = get_global_id(0), g = get_global_id(1) / GROUP, j = get_global_id(1) % GROUP;
    k_base += g * head_stride;
    v_base += g * head_stride;
    attend_decode(qkv, r, kv_head0 + g, j, pos[r], rope_cs, scale, k_chan + k_base + slots[r] * k_stride,
                  v_chan + v_base + slots[r] * v_stride, out, out_sums, 0, 0.0f);
}
