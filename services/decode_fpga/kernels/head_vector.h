// The arithmetic of one head vector the attention kernels share: RoPE, q . k, the output's store and
// the per-head RMSNorm. paged_attention.cl and decode_layers.cl include it (before paged_attention.h);
// DeviceContext.build inlines it. Defines: HEAD_DIM, GROUP (query heads per kv head), Q_DIM, KV_DIM.

#define HALF (HEAD_DIM / 2)

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

// q . k before its horizontal sum: NV lanes of products (paged_attention_scores sums 16 of them at once)
inline hvec dot_lanes(const hvec *qv, __global const float *k)
{
    hvec a = qv[0] * VLOADH(0, k);
    for (int i = 1; i < NV; ++i) a = fma(qv[i], VLOADH(i, k), a);
    return a;
}

inline float dot_head(const hvec *qv, __global const float *k) { return hsum(dot_lanes(qv, k)); }

// q . k of two head vectors in registers (the new position's key, roped in private memory)
inline float dot_regs(const hvec *qv, const hvec *kv)
{
    hvec c = qv[0] * kv[0];
    for (int i = 1; i < NV; ++i) c = fma(qv[i], kv[i], c);
    return hsum(c);
}

// out[r, h] = acc / denom, and its 32-blocks' sums when HEAD_DIM % 32 == 0 (out_sums: [rows, Q_DIM / 32],
// which a block GEMV of the output projection reads; otherwise the engine launches block_sums)
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

// The new position last (its weight joins the cached positions' sums after theirs, in every decode
// kernel, and a chunk row's own position in paged_attention.cl's, so both give a row the same bits),
// then out[r, h]: acc and denom hold the cached positions' sums, v_new the new value.
inline void store_with_new(hvec *acc, float denom, const float s_new, const float m, __global const float *v_new,
                           const int r, const int h, __global float *out, __global float *out_sums)
{
    const float w = exp(s_new - m);
    denom += w;
    for (int i = 0; i < NV; ++i) acc[i] = fma((hvec)(w), VLOADH(i, v_new), acc[i]);
    store_head(acc, denom, r, h, out, out_sums);
}

// The per-head RMSNorm of arch_ops.cl's head_rms_norm (Qwen3's q_norm / k_norm) on a head vector in
// private memory, with its expression, so a head normalized here (decode_layers.cl) and one normalized
// by that launch are the same bits.
inline void head_norm_private(float *v, __global const float *w, const float eps)
{
    float4 acc = (float4)(0.0f);
    for (int i = 0; i < HEAD_DIM / 4; ++i) { const float4 x = vload4(i, v); acc = fma(x, x, acc); }
    const float scale = rsqrt((acc.x + acc.y + acc.z + acc.w) / HEAD_DIM + eps);
    for (int i = 0; i < HEAD_DIM / 4; ++i) vstore4(vload4(i, w) * (vload4(i, v) * scale), i, v);
}
