// Decode attention of one query head, shared by attention.cl (a launch of its own) and
// decode_layers.cl (every layer in one launch), which include this file; DeviceContext.build
// inlines it. Defines: HEAD_DIM, GROUP (query heads per kv head), Q_DIM, KV_DIM.

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

// The softmax's first pass: the largest of m and the scaled scores of cached positions [0, n).
inline float max_score(const hvec *qv, __global const float *K, const int n, const float scale, float m)
{
    for (int t = 0; t < n; ++t) m = fmax(m, dot_head(qv, K + (size_t)t * HEAD_DIM) * scale);
    return m;
}

// The second pass over cached positions [0, n): acc += exp(s_t - m) * V[t]; returns the sum of
// the weights. 16 positions share one call of exp, a vector routine on PoCL (one scalar call per
// position was about a third of attention at 1000 positions). A scaled score is rounded before m is
// taken from it, in a statement of its own: written as one expression, `dot * scale - m` may be
// contracted into an fma (OpenCL's FP_CONTRACT), and PoCL did so for some head sizes (32) and not
// others (64), so the kernels that keep the scores in memory (paged_attention.cl's *_scores) gave
// other bits than these for those heads.
inline float weigh_values(const hvec *qv, __global const float *K, __global const float *V, const int n,
                          const float scale, const float m, hvec *acc)
{
    float16 wsum = (float16)(0.0f);
    int t = 0;
    for (; t + 16 <= n; t += 16) {
        float s[16], w[16];
        for (int k = 0; k < 16; ++k) {
            const float scaled = dot_head(qv, K + (size_t)(t + k) * HEAD_DIM) * scale;  // rounded: see below
            s[k] = scaled - m;
        }
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
        const float scaled = dot_head(qv, K + (size_t)t * HEAD_DIM) * scale;
        const float w = exp(scaled - m);
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

// The new position last (its weight joins the cached positions' sums after theirs, in every decode
// kernel), then out[r, h]: acc and denom hold the cached positions' sums, v_new the new value.
inline void store_with_new(hvec *acc, float denom, const float s_new, const float m, __global const float *v_new,
                           const int r, const int h, __global float *out, __global float *out_sums)
{
    const float w = exp(s_new - m);
    denom += w;
    for (int i = 0; i < NV; ++i) acc[i] = fma((hvec)(w), VLOADH(i, v_new), acc[i]);
    store_head(acc, denom, r, h, out, out_sums);
}

// The per-head RMSNorm of arch_ops.cl's head_rms_norm (Qwen3's q_norm / k_norm) on a head vector in
// private memory, with its expression, so a head normalized here and one normalized by that launch
// are the same bits.
inline void head_norm_private(float *v, __global const float *w, const float eps)
{
    float4 acc = (float4)(0.0f);
    for (int i = 0; i < HEAD_DIM / 4; ++i) { const float4 x = vload4(i, v); acc = fma(x, x, acc); }
    const float scale = rsqrt((acc.x + acc.y + acc.z + acc.w) / HEAD_DIM + eps);
    for (int i = 0; i < HEAD_DIM / 4; ++i) vstore4(vload4(i, w) * (vload4(i, v) * scale), i, v);
}

// Query head h (kv head kv_head, j-th of its group) of row r at position p: RoPE of its query and
// of the kv head's new key in registers; when j == 0 the new K and V are stored at p. Positions
// before p are read from the cache (K, V: the slot's planes), the new one from registers, so no
// work-item reads what another writes; the new position's weight joins the sums last. Writes
// out[r, h] and its block sums (store_head). qk_w: when not 0, the layer's q_norm | k_norm weights
// [2 HEAD_DIM], applied to the query and the key before RoPE (decode_layers.cl; a launch of its own,
// head_rms_norm, does it in the launch-by-launch path, which passes 0).
inline void attend_decode(__global const float *qkv, const int r, const int kv_head, const int j, const int p,
                          __global const float *rope_cs, const float scale, __global float *K, __global float *V,
                          __global float *out, __global float *out_sums, __global const float *qk_w,
                          const float qk_eps)
{
    const int h = kv_head * GROUP + j;
    __global const float *row = qkv + (size_t)r * (Q_DIM + 2 * KV_DIM);
    __global const float *v_new = row + Q_DIM + KV_DIM + kv_head * HEAD_DIM;
    float qf[HEAD_DIM], kf[HEAD_DIM];
    for (int i = 0; i < HEAD_DIM; ++i) {
        qf[i] = row[h * HEAD_DIM + i];
        kf[i] = row[Q_DIM + kv_head * HEAD_DIM + i];
    }
    if (qk_w) {
        head_norm_private(qf, qk_w, qk_eps);
        head_norm_private(kf, qk_w + HEAD_DIM, qk_eps);
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
    const float s_new = dot_regs(qv, kv) * scale;
    const float m = max_score(qv, K, p, scale, s_new);
    hvec acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = (hvec)(0.0f);
    const float denom = weigh_values(qv, K, V, p, scale, m, acc);
    store_with_new(acc, denom, s_new, m, v_new, r, h, out, out_sums);
}
