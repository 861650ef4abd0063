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

#define HALF (HEAD_DIM / 2)

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

// HF's rotate-half RoPE of one head vector held in private memory, in place.
inline void rope(float *v, const int pos, __global const float *rope_cs)
{
    __global const float *cs = rope_cs + (size_t)pos * HEAD_DIM;
    for (int i = 0; i < HALF; ++i) {
        const float c = cs[i], s = cs[HALF + i];
        const float a = v[i], b = v[i + HALF];
        v[i] = a * c - b * s;
        v[i + HALF] = b * c + a * s;
    }
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

// A head vector as NV registers: 16-wide when HEAD_DIM allows (on PoCL a chain of
// float4 FMAs was latency bound: 369 us a layer at 1000 positions, SmolLM2's 9 heads).
#if HEAD_DIM % 16 == 0
#define NV (HEAD_DIM / 16)
typedef float16 hvec;
#define VLOADH(i, p) vload16((i), (p))
#define VSTOREH(v, i, p) vstore16((v), (i), (p))
inline float hsum(const float16 a)
{
    const float8 s8 = a.lo + a.hi;
    const float4 s4 = s8.lo + s8.hi;
    return (s4.x + s4.y) + (s4.z + s4.w);
}
#else
#define NV (HEAD_DIM / 4)
typedef float4 hvec;
#define VLOADH(i, p) vload4((i), (p))
#define VSTOREH(v, i, p) vstore4((v), (i), (p))
inline float hsum(const float4 a) { return (a.x + a.y) + (a.z + a.w); }
#endif

inline float dot_head(const hvec *qv, __global const float *k)
{
    hvec a = qv[0] * VLOADH(0, k);
    for (int i = 1; i < NV; ++i) a = fma(qv[i], VLOADH(i, k), a);
    return hsum(a);
}

// The softmax's first pass: the largest of m and the scaled scores of cached positions [0, n).
inline float max_score(const hvec *qv, __global const float *K, const int n, const float scale, float m)
{
    for (int t = 0; t < n; ++t) m = fmax(m, dot_head(qv, K + (size_t)t * HEAD_DIM) * scale);
    return m;
}

// The second pass over cached positions [0, n): acc += exp(s_t - m) * V[t]; returns the sum of
// the weights. 16 positions share one call of exp, a vector routine on PoCL (one scalar call per
// position was about a third of attention at 1000 positions).
inline float weigh_values(const hvec *qv, __global const float *K, __global const float *V, const int n,
                          const float scale, const float m, hvec *acc)
{
    float16 wsum = (float16)(0.0f);
    int t = 0;
    for (; t + 16 <= n; t += 16) {
        float s[16], w[16];
        for (int k = 0; k < 16; ++k) s[k] = dot_head(qv, K + (size_t)(t + k) * HEAD_DIM) * scale - m;
        const float16 w16 = exp(vload16(0, s));
        vstore16(w16, 0, w);
        wsum += w16;
        for (int k = 0; k < 16; ++k)
            for (int i = 0; i < NV; ++i) acc[i] = fma((hvec)(w[k]), VLOADH(i, V + (size_t)(t + k) * HEAD_DIM), acc[i]);
    }
    const float8 w8 = wsum.lo + wsum.hi;
    const float4 w4 = w8.lo + w8.hi;
    float denom = (w4.x + w4.y) + (w4.z + w4.w);
    for (; t < n; ++t) {
        const float w = exp(dot_head(qv, K + (size_t)t * HEAD_DIM) * scale - m);
        denom += w;
        for (int i = 0; i < NV; ++i) acc[i] = fma((hvec)(w), VLOADH(i, V + (size_t)t * HEAD_DIM), acc[i]);
    }
    return denom;
}

// out[r, h] = acc / denom, and its 32-blocks' sums when HEAD_DIM % 32 == 0 (see attention)
inline void store_head(hvec *acc, const float denom, const int r, const int h, __global float *out,
                       __global float *out_sums)
{
    const float inv = 1.0f / denom;
    __global float *o = out + (size_t)r * Q_DIM + h * HEAD_DIM;
    for (int i = 0; i < NV; ++i) {
        acc[i] *= inv;
        VSTOREH(acc[i], i, o);
    }
#if HEAD_DIM % 32 == 0
    const int per_block = 32 / (HEAD_DIM / NV);  // head vectors per 32-block
    for (int b = 0; b < HEAD_DIM / 32; ++b) {
        float s = 0.0f;
        for (int i = b * per_block; i < (b + 1) * per_block; ++i) s += hsum(acc[i]);
        out_sums[(size_t)r * (Q_DIM / 32) + h * (HEAD_DIM / 32) + b] = s;
    }
#endif
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
// Work-items as in attention: each ropes its query head and its kv head's new K in registers;
// the first of a group (j == 0) also stores K and V at pos[r]. Positions before pos[r] are
// read from the cache, the new one from registers, so no work-item reads what another writes;
// the scores are the two launches' (the new position's weight joins the sums last).
// Prefill rows of one sequence read each other's K and V, so prefill keeps the two launches.
__kernel void rope_attention_decode(__global const float *qkv, __global const int *slots, __global const int *pos,
                                    __global const float *rope_cs, const int kv_head0, const float scale,
                                    __global float *k_chan, long k_base, const long k_stride,
                                    __global float *v_chan, long v_base, const long v_stride,
                                    const long head_stride, __global float *out, __global float *out_sums)
{
    const int r = get_global_id(0), g = get_global_id(1) / GROUP, j = get_global_id(1) % GROUP;
    const int kv_head = kv_head0 + g, h = kv_head * GROUP + j, p = pos[r];
    k_base += g * head_stride;
    v_base += g * head_stride;
    __global const float *row = qkv + (size_t)r * (Q_DIM + 2 * KV_DIM);
    __global const float *v_new = row + Q_DIM + KV_DIM + kv_head * HEAD_DIM;
    __global float *K = k_chan + k_base + slots[r] * k_stride;
    __global float *V = v_chan + v_base + slots[r] * v_stride;
    float qf[HEAD_DIM], kf[HEAD_DIM];
    for (int i = 0; i < HEAD_DIM; ++i) {
        qf[i] = row[h * HEAD_DIM + i];
        kf[i] = row[Q_DIM + kv_head * HEAD_DIM + i];
    }
    rope(qf, p, rope_cs);
    rope(kf, p, rope_cs);
    if (j == 0) {
        for (int i = 0; i < HEAD_DIM; ++i) {
            K[(size_t)p * HEAD_DIM + i] = kf[i];
            V[(size_t)p * HEAD_DIM + i] = v_new[i];
        }
    }
    hvec qv[NV], kv[NV];
    for (int i = 0; i < NV; ++i) {
        qv[i] = VLOADH(i, qf);
        kv[i] = VLOADH(i, kf);
    }
    // dot_head reads a __global K row; the new position's K is private, so its score is summed here
    hvec c = qv[0] * kv[0];
    for (int i = 1; i < NV; ++i) c = fma(qv[i], kv[i], c);
    const float s_new = hsum(c) * scale;
    const float m = max_score(qv, K, p, scale, s_new);
    hvec acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = (hvec)(0.0f);
    float denom = weigh_values(qv, K, V, p, scale, m, acc);
    const float w = exp(s_new - m);
    denom += w;
    for (int i = 0; i < NV; ++i) acc[i] = fma((hvec)(w), VLOADH(i, v_new), acc[i]);
    store_head(acc, denom, r, h, out, out_sums);
}
