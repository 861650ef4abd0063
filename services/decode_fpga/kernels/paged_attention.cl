// RoPE, the KV write and attention over the paged KV pool: the attention kernels of every step.
// One work-item per (row, head), the portable form; the *_scores kernels are a CPU's (one per
// (row, kv head)), the same bits.
//
// Pool layout (paged_attention.h): layer l, block b, k|v, kv head h, slot i, dim d at
//   pool[layer_base + b * BLOCK_STRIDE + kv * V_OFFSET + h * BLOCK_ELEMS + i * HEAD_DIM + d]
// with layer_base = l * num_blocks * BLOCK_STRIDE, i.e. [n_layers][num_blocks][2][N_KV][BLOCK_SIZE][HEAD_DIM].
// block_tables: [n_seqs][max_blocks] ints; row r belongs to sequence seq_of_row[r] and sits at
// position pos[r]: block block_tables[seq][pos / BLOCK_SIZE],
// slot pos % BLOCK_SIZE. The host checks every table entry a launch touches (paged_attention.py).
// qkv: [rows][Q_DIM + 2 KV_DIM] as the q|k|v GEMV writes it; out: [rows][Q_DIM]; out_sums:
// [rows][Q_DIM / 32] (written when HEAD_DIM % 32 == 0, see store_head).
// Defines: HEAD_DIM, GROUP, Q_DIM, KV_DIM, BLOCK_SIZE.

#include "head_vector.h"
#include "paged_attention.h"

// The RoPE angles' cosines and sines of every position, computed once at start-up:
// rope_cs[pos][0:HALF] = cos, rope_cs[pos][HALF:HEAD_DIM] = sin. On PoCL cos/sin are
// software routines (~20 us a launch when each decode step recomputed them).
__kernel void rope_table(__global const float *inv_freq, __global float *rope_cs)
{
    const int pos = get_global_id(0), i = get_global_id(1);
    const float angle = (float)pos * inv_freq[i];
    rope_cs[(size_t)pos * HEAD_DIM + i] = cos(angle);
    rope_cs[(size_t)pos * HEAD_DIM + HALF + i] = sin(angle);
}

// Rows of already-RoPE'd K and V into the pool (a prefill chunk's, or a hand-off's import).
// Work-item (r, h) copies kv head h of row r. The source is addressed by strides so that both q|k|v
// rows (src_base Q_DIM, row_stride QKV_ROW, kv_stride KV_DIM, head_stride HEAD_DIM) and the wire
// layout of one layer, [2][N_KV][n_tokens][HEAD_DIM] (row_stride HEAD_DIM, kv_stride N_KV n_tokens
// HEAD_DIM, head_stride n_tokens HEAD_DIM), are read in place:
//   K of (r, h): src[src_base + r row_stride + h head_stride + d], V: + kv_stride.
__kernel void paged_kv_write(__global const float *src, const long src_base, const long row_stride,
                             const long kv_stride, const long head_stride, __global const int *seq_of_row,
                             __global const int *pos, __global const int *block_tables, const int max_blocks,
                             __global float *pool, const long layer_base)
{
    const int r = get_global_id(0), h = get_global_id(1);
    __global const float *k = src + src_base + r * row_stride + h * head_stride;
    __global const float *v = k + kv_stride;
    __global const int *table = block_tables + (size_t)seq_of_row[r] * max_blocks;
    __global float *kd = paged_row(pool + layer_base + h * BLOCK_ELEMS, table, pos[r]);
    for (int i = 0; i < HEAD_DIM / 4; ++i) {
        vstore4(vload4(i, k), i, kd);
        vstore4(vload4(i, v), i, kd + V_OFFSET);
    }
}

// A prefill chunk's RoPE and KV write: work-item (r, g (GROUP + 1) + j) serves kv head g;
// j == 0 ropes its K in qkv and stores K and V at pos[r]; j in 1..GROUP ropes query head g GROUP + j-1.
// Global size (rows, N_KV (GROUP + 1)).
__kernel void paged_rope_store_kv(__global float *qkv, __global const int *seq_of_row, __global const int *pos,
                                  __global const float *rope_cs, __global const int *block_tables,
                                  const int max_blocks, __global float *pool, const long layer_base)
{
    const int r = get_global_id(0), g = get_global_id(1) / (GROUP + 1), j = get_global_id(1) % (GROUP + 1);
    paged_rope_store_item(qkv + (size_t)r * QKV_ROW, g, j, pos[r], rope_cs, pool + layer_base + g * BLOCK_ELEMS,
                          block_tables + (size_t)seq_of_row[r] * max_blocks, 0, 0.0f);
}

// Prefill-chunk (and general) attention through block tables: row r
// (query already roped in qkv) attends to positions [0, pos[r]] of its sequence, whose K and V
// must already be in the pool (paged_kv_write / paged_rope_store_kv of the chunk first). A chunk
// of C tokens at [start, start + C) is C rows at those positions: each sees the cached context
// and the chunk's tokens up to itself, which is the causal mask. Rows of several sequences mix
// freely. The row's own position joins last, as in a decode step (paged_attend_row,
// paged_attention.h). Work-item (r, h): query head h. Global size (rows, N_KV GROUP).
__kernel void paged_attention(__global const float *qkv, __global const int *seq_of_row, __global const int *pos,
                              __global const int *block_tables, const int max_blocks, __global const float *pool,
                              const long layer_base, const float scale, __global float *out,
                              __global float *out_sums)
{
    const int r = get_global_id(0), h = get_global_id(1);
    paged_attend_row(qkv, r, h, pos[r], pool + layer_base + (h / GROUP) * BLOCK_ELEMS,
                     block_tables + (size_t)seq_of_row[r] * max_blocks, scale, out, out_sums);
}

// A decode step's RoPE, KV write and attention in one launch (one command per layer instead of two;
// PoCL charges ~5 us per command): row r is one sequence's new token at pos[r] (its block must be in
// the table). Prefill rows of one sequence read each other's K and V, so they keep the two launches
// above. Work-item
// (r, g GROUP + j): query head g GROUP + j. Global size (rows, N_KV GROUP).
__kernel void paged_rope_attention_decode(__global const float *qkv, __global const int *seq_of_row,
                                          __global const int *pos, __global const float *rope_cs,
                                          __global const int *block_tables, const int max_blocks,
                                          __global float *pool, const long layer_base, const float scale,
                                          __global float *out, __global float *out_sums)
{
    const int r = get_global_id(0), g = get_global_id(1) / GROUP, j = get_global_id(1) % GROUP;
    paged_attend_decode(qkv, r, g, j, pos[r], rope_cs, scale, pool + layer_base + g * BLOCK_ELEMS,
                        block_tables + (size_t)seq_of_row[r] * max_blocks, out, out_sums, 0, 0.0f);
}

#ifdef MAX_POS
// paged_attention for a CPU device, the same bits, 1.3-2.1x faster (bench/micro/paged_attention.py --prefill:
// 16 rows at 2000 cached positions, 30 layers, 120 -> 75 ms on 2 Xeon cores). One work-item takes
// the GROUP query heads of one kv head, so each K and V row is loaded once for all of them, and
// computes each score once: the first pass keeps the scaled scores in local memory (GROUP x MAX_POS
// floats a work-group; on a CPU that is its caches) and the second pass reads them back where
// paged_attention computes every dot product again (group_scores, group_weigh).
// Work-item (r, g): query heads g GROUP .. g GROUP + GROUP - 1 of row r. Global size (rows, N_KV).
// Needs HEAD_DIM % 16 == 0, BLOCK_SIZE % 16 == 0, MAX_POS >= the longest context (paged_attention.py).
__kernel void paged_attention_scores(__global const float *qkv, __global const int *seq_of_row,
                                     __global const int *pos, __global const int *block_tables, const int max_blocks,
                                     __global const float *pool, const long layer_base, const float scale,
                                     __global float *out, __global float *out_sums)
{
    __local float scores[GROUP][MAX_POS];
    const int r = get_global_id(0), g = get_global_id(1);
    paged_attend_group(qkv, r, g, pos[r], pool + layer_base + g * BLOCK_ELEMS,
                       block_tables + (size_t)seq_of_row[r] * max_blocks, scale, scores, out, out_sums);
}

// paged_rope_attention_decode for a CPU device, the same bits: one work-item takes the GROUP query
// heads of one kv head (RoPE of each query and of the new key, the new K and V stored once) and
// computes each cached position's score once, where paged_attend_decode computes it twice for each
// query head (with SmolLM2's 3 query heads a kv head, each cached K row was read 6 times a layer and
// each V row 3 times; here once). The cached positions go through group_scores and group_weigh; the
// new position's score, from registers, joins the maximum and then the sums last, as in
// paged_attend_decode. Work-item (r, g): query heads g GROUP .. g GROUP + GROUP - 1 of row r, one
// sequence's new token at pos[r]. Global size (rows, N_KV). Needs what paged_attention_scores needs.
__kernel void paged_rope_attention_decode_scores(__global const float *qkv, __global const int *seq_of_row,
                                                 __global const int *pos, __global const float *rope_cs,
                                                 __global const int *block_tables, const int max_blocks,
                                                 __global float *pool, const long layer_base, const float scale,
                                                 __global float *out, __global float *out_sums)
{
    __local float scores[GROUP][MAX_POS];
    const int r = get_global_id(0), g = get_global_id(1), p = pos[r];
    __global const int *table = block_tables + (size_t)seq_of_row[r] * max_blocks;
    __global float *K = pool + layer_base + g * BLOCK_ELEMS;
    __global const float *row = qkv + (size_t)r * QKV_ROW;
    __global const float *v_new = row + Q_DIM + KV_DIM + g * HEAD_DIM;
    // the new key, roped, into the pool with its value; its scores against each query head
    float kf[HEAD_DIM];
    for (int i = 0; i < HEAD_DIM; ++i) kf[i] = row[Q_DIM + g * HEAD_DIM + i];
    rope(kf, p, rope_cs);
    paged_store_new(K, table, p, kf, v_new);
    hvec kv[NV];
    for (int i = 0; i < NV; ++i) kv[i] = VLOADH(i, kf);
    hvec qv[GROUP][NV];
    float s_new[GROUP], m[GROUP], denom[GROUP];
    for (int j = 0; j < GROUP; ++j) {
        float qf[HEAD_DIM];
        for (int i = 0; i < HEAD_DIM; ++i) qf[i] = row[(g * GROUP + j) * HEAD_DIM + i];
        rope(qf, p, rope_cs);
        for (int i = 0; i < NV; ++i) qv[j][i] = VLOADH(i, qf);
        m[j] = s_new[j] = dot_regs(qv[j], kv) * scale;
    }
    group_scores(qv, K, table, p, scale, scores, m);  // the cached positions [0, p)
    hvec acc[GROUP][NV];
    group_weigh(K, table, p, scores, m, acc, denom);
    for (int j = 0; j < GROUP; ++j)
        store_with_new(acc[j], denom[j], s_new[j], m[j], v_new, r, g * GROUP + j, out, out_sums);
}
#endif
