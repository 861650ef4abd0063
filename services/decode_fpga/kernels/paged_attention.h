// Attention of one query head over a paged KV pool, shared by paged_attention.cl and
// decode_layers.cl (every layer in one launch). Include head_vector.h BEFORE this file
// (kernel_source expands the top file's includes only, not a header's): it gives hvec, NV, VLOADH,
// dot_head, rope and store_head.
// Defines: HEAD_DIM, GROUP, Q_DIM, KV_DIM, BLOCK_SIZE (tokens per block).
//
// The pool of one layer: [num_blocks][2 (k|v)][N_KV][BLOCK_SIZE][HEAD_DIM] floats, layers one
// after the other (layer l starts at l * num_blocks * BLOCK_STRIDE). One head's K (or V) of one
// block is BLOCK_SIZE * HEAD_DIM contiguous floats (4 KiB at 16 x 64): wide loads and the
// hardware prefetcher see the same runs as in a contiguous cache, and the block table is read
// once per block (per 16-position tile when BLOCK_SIZE % 16 == 0).
// A block table is a row of ints: position t of its sequence lives in slot t % BLOCK_SIZE of
// block table[t / BLOCK_SIZE].
//
// Every function reduces over positions 0, 1, 2, ... in order with the tiles of
// paged_weigh_values (16 positions from position 0, then a scalar tail), and every kernel adds the
// row's own position after those before it, so a row's result depends on its own context only: not
// on the batch, not on where its blocks lie, not on whether it was decoded or came in a chunk.

#define N_KV (KV_DIM / HEAD_DIM)
#define BLOCK_ELEMS ((size_t)BLOCK_SIZE * HEAD_DIM)  // one head's K (or V) in one block
#define BLOCK_STRIDE (2 * N_KV * BLOCK_ELEMS)        // one block of one layer: K of every head, then V
#define V_OFFSET (N_KV * BLOCK_ELEMS)                // from a head's K in a block to its V

// Position t's row in the pool, from X: the layer's base plus the head's offset within a block
// (kv_head * BLOCK_ELEMS for K; + V_OFFSET for V).
inline __global float *paged_row(__global float *X, __global const int *table, const int t)
{
    return X + (size_t)table[t / BLOCK_SIZE] * BLOCK_STRIDE + (size_t)(t % BLOCK_SIZE) * HEAD_DIM;
}

inline __global const float *paged_row_c(__global const float *X, __global const int *table, const int t)
{
    return X + (size_t)table[t / BLOCK_SIZE] * BLOCK_STRIDE + (size_t)(t % BLOCK_SIZE) * HEAD_DIM;
}

// The softmax's first pass: the largest of m and the scaled scores of positions [0, n). One table
// lookup per block.
inline float paged_max_score(const hvec *qv, __global const float *K, __global const int *table, const int n,
                             const float scale, float m)
{
    for (int b = 0; b * BLOCK_SIZE < n; ++b) {
        __global const float *kb = K + (size_t)table[b] * BLOCK_STRIDE;
        const int end = min(BLOCK_SIZE, n - b * BLOCK_SIZE);
        for (int i = 0; i < end; ++i) m = fmax(m, dot_head(qv, kb + (size_t)i * HEAD_DIM) * scale);
    }
    return m;
}

// The second pass over positions [0, n): acc += exp(s_t - m) * V[t]; returns the sum of the weights.
// K: the layer's base + kv_head * BLOCK_ELEMS (V is V_OFFSET further in every block). 16 positions
// share one call of exp, a vector routine on PoCL (one scalar call per position was about a third of
// attention at 1000 positions). A scaled score is rounded before m is taken from it, in a statement of
// its own: written as one expression, `dot * scale - m` may be contracted into an fma (OpenCL's
// FP_CONTRACT), and PoCL did so for some head sizes (32) and not others (64), so the kernels that keep
// the scores in memory (paged_attention.cl's *_scores) gave other bits than these for those heads.
inline float paged_weigh_values(const hvec *qv, __global const float *K, __global const int *table, const int n,
                                const float scale, const float m, hvec *acc)
{
    float16 wsum = (float16)(0.0f);
    int t = 0;
    for (; t + 16 <= n; t += 16) {
        float s[16], w[16];
#if BLOCK_SIZE % 16 == 0
        // a tile never straddles two blocks: one lookup, then rows of one run
        __global const float *kt = paged_row_c(K, table, t);
#define TILE_ROW(k) (kt + (size_t)(k) * HEAD_DIM)
#else
#define TILE_ROW(k) paged_row_c(K, table, t + (k))
#endif
        for (int k = 0; k < 16; ++k) {
            const float scaled = dot_head(qv, TILE_ROW(k)) * scale;  // rounded: see above
            s[k] = scaled - m;
        }
        const float16 w16 = exp(vload16(0, s));
        vstore16(w16, 0, w);
        wsum += w16;
        for (int k = 0; k < 16; ++k)
            for (int i = 0; i < NV; ++i) acc[i] = fma((hvec)(w[k]), VLOADH(i, TILE_ROW(k) + V_OFFSET), acc[i]);
#undef TILE_ROW
    }
    const float8 w8 = wsum.lo + wsum.hi;
    const float4 w4 = w8.lo + w8.hi;
    float denom = (w4.x + w4.y) + (w4.z + w4.w);
    for (; t < n; ++t) {
        __global const float *kr = paged_row_c(K, table, t);
        const float scaled = dot_head(qv, kr) * scale;
        const float w = exp(scaled - m);
        denom += w;
        for (int i = 0; i < NV; ++i) acc[i] = fma((hvec)(w), VLOADH(i, kr + V_OFFSET), acc[i]);
    }
    return denom;
}

// The new position's roped key (private) and its value into the pool at p. K: as paged_row's X.
inline void paged_store_new(__global float *K, __global const int *table, const int p, const float *kf,
                            __global const float *v_new)
{
    __global float *kd = paged_row(K, table, p);
    for (int i = 0; i < HEAD_DIM; ++i) {
        kd[i] = kf[i];
        kd[V_OFFSET + i] = v_new[i];
    }
}

// Query head h = kv_head * GROUP + j of row r at position p: RoPE of its query and of the kv head's
// new key in registers; j == 0 stores the new K and V at p (its block must be in the table).
// Positions [0, p) come from the pool, the new one from registers, so no work-item reads what another
// writes; the new position's weight joins the sums last. Writes out[r, h] and its block sums
// (store_head). K: the layer's base + kv_head * BLOCK_ELEMS. qk_w: when not 0, the layer's
// q_norm | k_norm weights [2 HEAD_DIM], applied to the query and the key before RoPE (decode_layers.cl;
// a launch of its own, head_rms_norm, does it in the launch-by-launch step, which passes 0).
inline void paged_attend_decode(__global const float *qkv, const int r, const int kv_head, const int j, const int p,
                                __global const float *rope_cs, const float scale, __global float *K,
                                __global const int *table, __global float *out, __global float *out_sums,
                                __global const float *qk_w, const float qk_eps)
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
    if (j == 0) paged_store_new(K, table, p, kf, v_new);
    hvec qv[NV], kv[NV];
    for (int i = 0; i < NV; ++i) {
        qv[i] = VLOADH(i, qf);
        kv[i] = VLOADH(i, kf);
    }
    const float s_new = dot_regs(qv, kv) * scale;
    const float m = paged_max_score(qv, K, table, p, scale, s_new);
    hvec acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = (hvec)(0.0f);
    const float denom = paged_weigh_values(qv, K, table, p, scale, m, acc);
    store_with_new(acc, denom, s_new, m, v_new, r, h, out, out_sums);
}

// ---- a chunk's rows (paged_attention.cl's prefill kernels, decode_layers.cl's several-row step) ----

#ifndef QKV_ROW
#define QKV_ROW (Q_DIM + 2 * KV_DIM)
#endif

// A head vector in global memory, normalized (qk_w not 0: Qwen3's per-head RMSNorm, head_norm_private:
// arch_ops.cl's head_rms_norm's bits) and roped, in place.
inline void norm_rope_in_place(__global float *v, const int pos, __global const float *rope_cs,
                               __global const float *qk_w, const float qk_eps)
{
    float t[HEAD_DIM];
    for (int i = 0; i < HEAD_DIM; ++i) t[i] = v[i];
    if (qk_w) head_norm_private(t, qk_w, qk_eps);
    rope(t, pos, rope_cs);
    for (int i = 0; i < HEAD_DIM; ++i) v[i] = t[i];
}

// Item j of kv head g of the q|k|v row `row` at position p: j == 0 ropes the head's K in place and
// stores K and V at p (K: the layer's base + g * BLOCK_ELEMS); j in 1..GROUP ropes query head
// g GROUP + j - 1 in place. qk_w: as paged_attend_decode's (q_norm | k_norm), or 0.
inline void paged_rope_store_item(__global float *row, const int g, const int j, const int p,
                                  __global const float *rope_cs, __global float *K, __global const int *table,
                                  __global const float *qk_w, const float qk_eps)
{
    if (j > 0) {
        norm_rope_in_place(row + (g * GROUP + j - 1) * HEAD_DIM, p, rope_cs, qk_w, qk_eps);
        return;
    }
    __global float *k = row + Q_DIM + g * HEAD_DIM;
    __global const float *v = row + Q_DIM + KV_DIM + g * HEAD_DIM;
    norm_rope_in_place(k, p, rope_cs, qk_w ? qk_w + HEAD_DIM : 0, qk_eps);
    __global float *kd = paged_row(K, table, p);
    for (int i = 0; i < HEAD_DIM / 4; ++i) {
        vstore4(vload4(i, k), i, kd);
        vstore4(vload4(i, v), i, kd + V_OFFSET);
    }
}

// Query head h of row r (roped, in qkv) at position p over positions [0, p] of its sequence, whose K
// and V are in the pool (K: the layer's base + (h / GROUP) * BLOCK_ELEMS). The row's own position
// joins last, after the positions before it, as in a decode step (paged_attend_decode), so a chunk's
// row is the bits of the same token decoded alone: a verify step's rows (speculation) are the decode
// steps' (a row's own position inside the tiles of 16 rounded otherwise, which int8 activations
// turned into other tokens).
inline void paged_attend_row(__global const float *qkv, const int r, const int h, const int p,
                             __global const float *K, __global const int *table, const float scale,
                             __global float *out, __global float *out_sums)
{
    __global const float *q = qkv + (size_t)r * QKV_ROW + h * HEAD_DIM;
    hvec qv[NV];
    for (int i = 0; i < NV; ++i) qv[i] = VLOADH(i, q);
    __global const float *kp = paged_row_c(K, table, p);  // the row's own key and value
    const float s_own = dot_head(qv, kp) * scale;
    const float m = paged_max_score(qv, K, table, p, scale, s_own);
    hvec acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = (hvec)(0.0f);
    const float denom = paged_weigh_values(qv, K, table, p, scale, m, acc);
    store_with_new(acc, denom, s_own, m, kp + V_OFFSET, r, h, out, out_sums);
}

#ifdef MAX_POS
// ---- a CPU's attention of a kv head's GROUP query heads at once (the *_scores kernels) ----
// hsum (head_vector.h) of 16 head vectors at once: lane k of the result is hsum(a[k]) by the same
// tree of additions (lane i + lane i + 8, then + lane i + 4, then (x + y) + (z + w)), so the same bits,
// with the additions of 16 positions sharing vector instructions.
inline float16 hsum16_lanes(const float16 *a)
{
    float16 b[8], c[4], d[2];
    for (int k = 0; k < 8; ++k) b[k] = (float16)(a[2 * k].lo, a[2 * k + 1].lo) + (float16)(a[2 * k].hi, a[2 * k + 1].hi);
    for (int k = 0; k < 4; ++k)
        c[k] = (float16)(b[2 * k].s0123, b[2 * k].s89ab, b[2 * k + 1].s0123, b[2 * k + 1].s89ab)
             + (float16)(b[2 * k].s4567, b[2 * k].scdef, b[2 * k + 1].s4567, b[2 * k + 1].scdef);
    for (int k = 0; k < 2; ++k) d[k] = (float16)(c[2 * k].even, c[2 * k + 1].even) + (float16)(c[2 * k].odd, c[2 * k + 1].odd);
    return (float16)(d[0].even, d[1].even) + (float16)(d[0].odd, d[1].odd);
}

// The first pass of the *_scores kernels: the scaled scores of positions [0, n) of a kv head's GROUP
// query heads into `scores`, computed once each, and into m[j] the largest of m[j] and head j's scores.
// A score is the same expression as paged_weigh_values' (tiles of 16 reduce with hsum16_lanes), and fmax
// gives the same maximum in any order.
inline void group_scores(hvec qv[GROUP][NV], __global const float *K, __global const int *table, const int n,
                         const float scale, __local float scores[GROUP][MAX_POS], float *m)
{
    float16 top[GROUP];
    for (int j = 0; j < GROUP; ++j) top[j] = (float16)(-INFINITY);
    int t = 0;
    for (; t + 16 <= n; t += 16) {
        __global const float *kt = paged_row_c(K, table, t);  // a tile within one block
        for (int j = 0; j < GROUP; ++j) {
            float16 a[16];
            for (int k = 0; k < 16; ++k) a[k] = dot_lanes(qv[j], kt + (size_t)k * HEAD_DIM);
            const float16 s = hsum16_lanes(a) * scale;
            vstore16(s, 0, &scores[j][t]);
            top[j] = fmax(top[j], s);
        }
    }
    for (int j = 0; j < GROUP; ++j) {
        const float8 m8 = fmax(top[j].lo, top[j].hi);
        const float4 m4 = fmax(m8.lo, m8.hi);
        m[j] = fmax(m[j], fmax(fmax(m4.x, m4.y), fmax(m4.z, m4.w)));
    }
    for (; t < n; ++t) {
        __global const float *kr = paged_row_c(K, table, t);
        for (int j = 0; j < GROUP; ++j) {
            scores[j][t] = dot_head(qv[j], kr) * scale;
            m[j] = fmax(m[j], scores[j][t]);
        }
    }
}

// The second pass: paged_weigh_values' tiles of 16 positions of [0, n), then its tail, for the GROUP
// heads at once (each V row loaded once for all of them): acc[j] += exp(s_t - m[j]) V[t]; denom[j]:
// the sum of head j's weights, tile for tile paged_weigh_values' bits.
inline void group_weigh(__global const float *K, __global const int *table, const int n,
                        __local float scores[GROUP][MAX_POS], const float *m, hvec acc[GROUP][NV], float *denom)
{
    float16 wsum[GROUP];
    for (int j = 0; j < GROUP; ++j) {
        wsum[j] = (float16)(0.0f);
        for (int i = 0; i < NV; ++i) acc[j][i] = (hvec)(0.0f);
    }
    int t = 0;
    for (; t + 16 <= n; t += 16) {
        __global const float *vt = paged_row_c(K, table, t) + V_OFFSET;
        float w[GROUP][16];
        for (int j = 0; j < GROUP; ++j) {
            const float16 w16 = exp(vload16(0, &scores[j][t]) - (float16)(m[j]));
            vstore16(w16, 0, w[j]);
            wsum[j] += w16;
        }
        for (int k = 0; k < 16; ++k)
            for (int i = 0; i < NV; ++i) {
                const hvec v = VLOADH(i, vt + (size_t)k * HEAD_DIM);
                for (int j = 0; j < GROUP; ++j) acc[j][i] = fma((hvec)(w[j][k]), v, acc[j][i]);
            }
    }
    for (int j = 0; j < GROUP; ++j) {
        const float8 w8 = wsum[j].lo + wsum[j].hi;
        const float4 w4 = w8.lo + w8.hi;
        denom[j] = (w4.x + w4.y) + (w4.z + w4.w);
        for (int u = t; u < n; ++u) {
            __global const float *vr = paged_row_c(K, table, u) + V_OFFSET;
            const float w = exp(scores[j][u] - m[j]);
            denom[j] += w;
            for (int i = 0; i < NV; ++i) acc[j][i] = fma((hvec)(w), VLOADH(i, vr), acc[j][i]);
        }
    }
}

// paged_attention_scores' work: the GROUP query heads of kv head g of row r (roped, in qkv) at position
// p, each cached score computed once into `scores`, the row's own position last (paged_attend_row's
// bits). K: the layer's base + g * BLOCK_ELEMS.
inline void paged_attend_group(__global const float *qkv, const int r, const int g, const int p,
                               __global const float *K, __global const int *table, const float scale,
                               __local float scores[GROUP][MAX_POS], __global float *out, __global float *out_sums)
{
    __global const float *kp = paged_row_c(K, table, p);  // the row's own key and value, joining last
    hvec qv[GROUP][NV];
    float s_own[GROUP], m[GROUP], denom[GROUP];
    for (int j = 0; j < GROUP; ++j) {
        for (int i = 0; i < NV; ++i) qv[j][i] = VLOADH(i, qkv + (size_t)r * QKV_ROW + (g * GROUP + j) * HEAD_DIM);
        m[j] = s_own[j] = dot_head(qv[j], kp) * scale;
    }
    group_scores(qv, K, table, p, scale, scores, m);  // the positions before it, [0, p)
    hvec acc[GROUP][NV];
    group_weigh(K, table, p, scores, m, acc, denom);
    for (int j = 0; j < GROUP; ++j)
        store_with_new(acc[j], denom[j], s_own[j], m[j], kp + V_OFFSET, r, g * GROUP + j, out, out_sums);
}
#endif
