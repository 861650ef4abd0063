// Every layer of a paged step of one decode row in one launch, for a CPU device
// (paged_decode_layers; paged_plans.py binds it over the pool, bit for bit the step's launches).
//
// On PoCL every command costs ~15 us beyond its work (the runtime's bookkeeping, both worker
// threads waking and meeting at its end), and a layer was five commands. Here the launch has as
// many work-groups as the device has compute units (PoCL's worker threads), one work-item
// each, and the phases are separated by a barrier across work-groups: a counter in global
// memory that every work-group increments and then spins on, ~0.3 us where a command boundary
// costs ~15. A GEMV's rows are split into one contiguous range per work-group; heads and
// activation blocks are taken one at a time from a shared counter.
//
// The weights of every layer live in one buffer (packed_arrays.py), at the byte offsets of
// table[layer][0:14]: attn_norm, ffn_norm, then d, m, q of q|k|v, o, gate|up and down;
// table[layer][14:18] are those four matrices' block formats (quant_blocks.h's codes), which may
// differ between matrices and layers (a Q4_K_M file: Q4_K and Q6_K ffn_down, Q5_0 elsewhere).
//
// Each layer's phases, each with the expression of the kernel it replaces, so the outputs are
// those of the five launches a layer bit for bit:
//   1. RMSNorm of x (norm_row.h, each work-group its own copy), then rows of q|k|v (ROW_DOT)
//   2. per query head: RoPE, the KV write, attention (paged_attend_decode, paged_attention.h)
//   3. rows of the output projection, added into x
//   4. RMSNorm of x, then rows of gate|up
//   5. blocks of silu(gate) * up and their sums (silu.h)
//   6. rows of the down projection, added into x
//
// Work-groups must all run at once: OpenCL does not promise it, PoCL's pthread device does when
// there are no more work-groups than worker threads (each takes one), and while no other process
// takes one of its cores. A work-group that has polled its barriers SPIN_LIMIT times in a step
// sets sync[0] and every work-group returns; the host then redoes the step launch by launch
// (engine.py), and counts it when it chooses how the next steps run (one_launch_choice.py).
//
// With -DQKV_BIAS (Qwen2's q/k/v biases) the kernel takes one more argument, qkv_bias: every layer's
// [QKV_ROWS] biases one after the other, added by each work-group to its rows of q|k|v right after
// its GEMV, as arch_ops.cl's add_bias adds them after the launch-by-launch GEMV: the same bits.
// With -DQK_NORM (Qwen3's per-head q/k RMSNorm) it takes qk_norm (after qkv_bias when both): every
// layer's q_norm | k_norm [2 HEAD_DIM], applied in phase 2 by paged_attend_decode to each head before RoPE,
// with head_rms_norm's expression (the launches' bits).
//
// Defines: QFMT_SET (a bit per block format the layers hold, quant_gemv.py's QFMT_BITS: the GEMV
// of each format is compiled in once and chosen per matrix), HIDDEN, FF, HEAD_DIM, GROUP, Q_DIM,
// KV_DIM, XL = max(HIDDEN, FF, Q_DIM), LINE: ints between two counters of sync, each on a
// cache line of its own (spinning reads and claims), the host's SYNC_LINE, and SPIN_LIMIT (a
// long; the host's BARRIER_SPIN_LIMIT).
// HIDDEN, FF, Q_DIM: multiples of 32. BLOCK_SIZE: the pool's tokens per block.

#define XAS __local
#include "quant_blocks.h"
#include "head_vector.h"
#include "paged_attention.h"
#include "norm_row.h"
#include "silu.h"

#define N_HEADS (Q_DIM / HEAD_DIM)
#define TABLE_INTS 18  // per layer: 14 byte offsets, 4 formats
#define QKV_ROWS (Q_DIM + 2 * KV_DIM)

// sync[0]: set when a barrier gave up; sync[LINE]: arrivals at barriers; sync[LINE (2 + 2 l)]
// and sync[LINE (3 + 2 l)]: heads and activation blocks taken in layer l. The host zeroes them
// before every step (clear_ints, elementwise.cl).
#define FAILED(sync) ((volatile __global int *)(sync))

// Every work-group has arrived here for the n-th time; false when one gave up waiting. spun: this
// work-group's polls at every barrier of the step so far: past SPIN_LIMIT it gives up, so a step
// beside a busy process stalls for at most that long, however many barriers it waits at.
inline bool all_arrived(__global int *sync, const int n, long *spun)
{
    volatile __global int *arrivals = (volatile __global int *)(sync + LINE);
    const int target = n * (int)get_num_groups(0);
    mem_fence(CLK_GLOBAL_MEM_FENCE);  // this work-group's writes before its arrival
    atomic_inc(arrivals);
    for (; *arrivals < target; ++*spun) {
        if (*spun > SPIN_LIMIT || *FAILED(sync)) {
            atomic_xchg(FAILED(sync), 1);
            return false;
        }
    }
    mem_fence(CLK_GLOBAL_MEM_FENCE);  // the others' writes after their arrivals
    return true;
}

// Y[o] (+)= row o of the [ROWS, COLS] matrix (D, M, Q) . XV (XSV: its block sums), for this
// work-group's share of the rows: a contiguous range, so each core streams its part of the
// matrix in order (rows dealt out in chunks from a counter measured 30% slower: the hardware
// prefetchers restart at every chunk)
#define GEMV_ROWS_F(F, ROWS, COLS, D, M, Q, XV, XSV, Y, ACCUMULATE)                              \
    do {                                                                                         \
        const int g_ = get_group_id(0), ng_ = get_num_groups(0);                                 \
        const int end_ = (int)(((long)(ROWS) * (g_ + 1)) / ng_);                                 \
        for (int o = (int)(((long)(ROWS) * g_) / ng_); o < end_; ++o)                            \
            GEMV_ROW_F(F, o, (D), (M), (Q), (XV), (XSV), (COLS), (Y), (ACCUMULATE));             \
    } while (0)

// M(F, ...) for the matrix's format FMT (a run-time value from the table): one branch per format
// in QFMT_SET (quant_gemv.py's QFMT_BITS), each compiled for its constant format
#define HAS_QFMT(F, BIT) (((QFMT_SET) >> (BIT)) & 1)
#define BY_QFMT(FMT, M, ...)                                                                     \
    do {                                                                                         \
        if (HAS_QFMT(40, 0) && (FMT) == 40) M(40, __VA_ARGS__);                                  \
        else if (HAS_QFMT(41, 1) && (FMT) == 41) M(41, __VA_ARGS__);                             \
        else if (HAS_QFMT(80, 2) && (FMT) == 80) M(80, __VA_ARGS__);                             \
        else if (HAS_QFMT(50, 3) && (FMT) == 50) M(50, __VA_ARGS__);                             \
        else if (HAS_QFMT(51, 4) && (FMT) == 51) M(51, __VA_ARGS__);                             \
        else if (HAS_QFMT(42, 5) && (FMT) == 42) M(42, __VA_ARGS__);                             \
        else if (HAS_QFMT(52, 6) && (FMT) == 52) M(52, __VA_ARGS__);                             \
        else if (HAS_QFMT(62, 7) && (FMT) == 62) M(62, __VA_ARGS__);                             \
    } while (0)
#define GEMV_ROWS(FMT, ...) BY_QFMT(FMT, GEMV_ROWS_F, __VA_ARGS__)

#define F32(k) ((__global const float *)(w + tab[k]))
#define F16(k) ((__global const half *)(w + tab[k]))
#define U8(k) (w + tab[k])

#ifdef QK_NORM
#define QK_W(layer) (qk_norm + (size_t)(layer) * 2 * HEAD_DIM)
#else
#define QK_W(layer) 0
#endif

// the architecture's arguments, last, where it has those parts (arch_parts.py's one_launch_args)
#if defined(QKV_BIAS) && defined(QK_NORM)
#define ARCH_ARGS , __global const float *qkv_bias, __global const float *qk_norm
#elif defined(QKV_BIAS)
#define ARCH_ARGS , __global const float *qkv_bias
#elif defined(QK_NORM)
#define ARCH_ARGS , __global const float *qk_norm
#else
#define ARCH_ARGS
#endif

// pool: [n_layers][num_blocks][2][N_KV][BLOCK_SIZE][HEAD_DIM], layer_elems floats a layer;
// row 0 is sequence seq_of_row[0] (its table: block_tables[seq_of_row[0]][0:max_blocks]) at pos[0]
__kernel void paged_decode_layers(__global float *x, __global const uchar *w, __global const int *table,
                                  const int n_layers, const float eps,
                                  __global float *qkv, __global float *attn, __global float *attn_sums,
                                  __global float *gu, __global float *act, __global float *act_sums,
                                  __global const int *seq_of_row, __global const int *pos,
                                  __global const float *rope_cs, const float scale, __global float *pool,
                                  const long layer_elems, __global const int *block_tables, const int max_blocks,
                                  __global int *sync ARCH_ARGS)
{
    __global const int *seq_table = block_tables + (size_t)seq_of_row[0] * max_blocks;
#define ATTEND_HEAD(h) paged_attend_decode(qkv, 0, (h) / GROUP, (h) % GROUP, p, rope_cs, scale,             \
                                           pool + layer * layer_elems + ((h) / GROUP) * BLOCK_ELEMS,       \
                                           seq_table, attn, attn_sums, QK_W(layer), eps)
    __local float xl[XL], xsl[XL / 32];  // the current phase's input vector and its block sums
    const int p = pos[0];
    int n = 0;  // barriers passed
    long spun = 0;  // polls at them
    for (int layer = 0; layer < n_layers; ++layer) {
        __global const int *tab = table + TABLE_INTS * layer;
        __global int *heads_taken = sync + LINE * (2 + 2 * layer), *blocks_taken = sync + LINE * (3 + 2 * layer);
        if (layer > 0 && !all_arrived(sync, ++n, &spun)) return;  // the last layer's residual is complete

        // 1. attention RMSNorm, q|k|v
        RMS_NORM_ROW(xl, xsl, x, F32(0), eps, HIDDEN);
        GEMV_ROWS(tab[14], QKV_ROWS, HIDDEN, F32(2), F16(3), U8(4), xl, xsl, qkv, 0);
#ifdef QKV_BIAS
        {  // this work-group's rows of GEMV_ROWS, their biases added
            const int g_ = get_group_id(0), ng_ = get_num_groups(0);
            __global const float *b_ = qkv_bias + (size_t)layer * QKV_ROWS;
            for (int o = (int)(((long)QKV_ROWS * g_) / ng_); o < (int)(((long)QKV_ROWS * (g_ + 1)) / ng_); ++o)
                qkv[o] += b_[o];
        }
#endif
        if (!all_arrived(sync, ++n, &spun)) return;

        // 2. RoPE, the KV write and attention, a query head at a time
        for (int h = atomic_inc(heads_taken); h < N_HEADS; h = atomic_inc(heads_taken)) ATTEND_HEAD(h);
        if (!all_arrived(sync, ++n, &spun)) return;

        // 3. the output projection into the residual
        for (int i = 0; i < Q_DIM; ++i) xl[i] = attn[i];
        for (int b = 0; b < Q_DIM / 32; ++b) xsl[b] = attn_sums[b];
        GEMV_ROWS(tab[15], HIDDEN, Q_DIM, F32(5), F16(6), U8(7), xl, xsl, x, 1);
        if (!all_arrived(sync, ++n, &spun)) return;

        // 4. MLP RMSNorm, gate|up
        RMS_NORM_ROW(xl, xsl, x, F32(1), eps, HIDDEN);
        GEMV_ROWS(tab[16], 2 * FF, HIDDEN, F32(8), F16(9), U8(10), xl, xsl, gu, 0);
        if (!all_arrived(sync, ++n, &spun)) return;

        // 5. silu(gate) * up, a 32-block at a time, its sum in silu_mul's order
        for (int b = atomic_inc(blocks_taken); b < FF / 32; b = atomic_inc(blocks_taken))
            SILU_MUL_BLOCK(act_sums[b], gu, gu + FF, b, act);
        if (!all_arrived(sync, ++n, &spun)) return;

        // 6. the down projection into the residual
        for (int i = 0; i < FF; ++i) xl[i] = act[i];
        for (int b = 0; b < FF / 32; ++b) xsl[b] = act_sums[b];
        GEMV_ROWS(tab[17], HIDDEN, FF, F32(11), F16(12), U8(13), xl, xsl, x, 1);
    }
}

#ifdef ROWS
// ---- several rows in one launch (ROWS at most): paged_rows_layers -------------------------------
//
// The step's rows r < n_rows[0] (decodes of several sequences, a speculative verify chunk, a short
// prompt chunk; 2 to ROWS of them) through every layer in one launch, the phases of
// paged_decode_layers with each row's arithmetic that of the launch-by-launch step: the GEMVs take
// every row of x per block of weights (GEMV_ROW_N_F: each row ROW_DOT_F's terms), and attention runs
// as the prefill launches run it, the RoPE and the KV write of every row first (a row of a chunk reads
// the K and V of the rows before it), then each (row, query head) (paged_attend_row: the row's own
// position last, the decode kernels' bits), or with MAX_POS (a CPU's local memory holds a kv head's
// scores) each (row, kv head) with its query heads at once (paged_attend_group, the same bits).
// Sync: sync[LINE (2 + 3 l)], [LINE (3 + 3 l)] and [LINE (4 + 3 l)] count the KV items, heads (or kv
// heads) and activation blocks taken in layer l.

#define GEMV_ROWS_N_F(F, OUT, COLS, D, M, Q, Y, YS, ACCUMULATE)                                 \
    do {                                                                                         \
        const int g_ = get_group_id(0), ng_ = get_num_groups(0);                                 \
        const int end_ = (int)(((long)(OUT) * (g_ + 1)) / ng_);                                  \
        for (int o = (int)(((long)(OUT) * g_) / ng_); o < end_; ++o)                             \
            GEMV_ROW_N_F(F, o, (D), (M), (Q), &xr[0][0], XL, &xsr[0][0], XL / 32, nr, (COLS), (Y), (YS), \
                         (ACCUMULATE));                                                          \
    } while (0)
#define GEMV_ROWS_N(FMT, ...) BY_QFMT(FMT, GEMV_ROWS_N_F, __VA_ARGS__)
// the step's rows of SRC [rows, COLS] and their block sums SUMS into xr and xsr, a GEMV's input
#define LOAD_ROWS(SRC, SUMS, COLS)                                                               \
    for (int r = 0; r < nr; ++r) {                                                               \
        for (int i = 0; i < (COLS); ++i) xr[r][i] = (SRC)[(size_t)r * (COLS) + i];               \
        for (int b = 0; b < (COLS) / 32; ++b) xsr[r][b] = (SUMS)[(size_t)r * ((COLS) / 32) + b]; \
    }

__kernel void paged_rows_layers(__global float *x, __global const uchar *w, __global const int *table,
                                const int n_layers, const float eps,
                                __global float *qkv, __global float *attn, __global float *attn_sums,
                                __global float *gu, __global float *act, __global float *act_sums,
                                __global const int *n_rows, __global const int *seq_of_row, __global const int *pos,
                                __global const float *rope_cs, const float scale, __global float *pool,
                                const long layer_elems, __global const int *block_tables, const int max_blocks,
                                __global int *sync ARCH_ARGS)
{
    __local float xr[ROWS][XL], xsr[ROWS][XL / 32];  // the current phase's input rows and their block sums
#ifdef MAX_POS
    __local float scores[GROUP][MAX_POS];  // paged_attend_group's: a kv head's scores of one row
#endif
    const int nr = min(n_rows[0], ROWS);
    int n = 0;  // barriers passed
    long spun = 0;  // polls at them
#define ROW_TABLE(r) (block_tables + (size_t)seq_of_row[r] * max_blocks)
    for (int layer = 0; layer < n_layers; ++layer) {
        __global const int *tab = table + TABLE_INTS * layer;
        __global int *kv_taken = sync + LINE * (2 + 3 * layer), *heads_taken = sync + LINE * (3 + 3 * layer);
        __global int *blocks_taken = sync + LINE * (4 + 3 * layer);
        __global float *layer_pool = pool + layer * layer_elems;
        if (layer > 0 && !all_arrived(sync, ++n, &spun)) return;  // the last layer's residual is complete

        // 1. attention RMSNorm of every row, q|k|v
        for (int r = 0; r < nr; ++r) RMS_NORM_ROW(xr[r], xsr[r], x + (size_t)r * HIDDEN, F32(0), eps, HIDDEN);
        GEMV_ROWS_N(tab[14], QKV_ROWS, HIDDEN, F32(2), F16(3), U8(4), qkv, QKV_ROWS, 0);
#ifdef QKV_BIAS
        {  // this work-group's outputs of GEMV_ROWS_N, their biases added to every row
            const int g_ = get_group_id(0), ng_ = get_num_groups(0);
            __global const float *b_ = qkv_bias + (size_t)layer * QKV_ROWS;
            for (int o = (int)(((long)QKV_ROWS * g_) / ng_); o < (int)(((long)QKV_ROWS * (g_ + 1)) / ng_); ++o)
                for (int r = 0; r < nr; ++r) qkv[(size_t)r * QKV_ROWS + o] += b_[o];
        }
#endif
        if (!all_arrived(sync, ++n, &spun)) return;

        // 2. RoPE and the KV write of every row (paged_rope_store_kv's items), then attention a (row,
        // head) at a time
        for (int t = atomic_inc(kv_taken); t < nr * N_KV * (GROUP + 1); t = atomic_inc(kv_taken)) {
            const int r = t / (N_KV * (GROUP + 1)), g = (t % (N_KV * (GROUP + 1))) / (GROUP + 1);
            paged_rope_store_item(qkv + (size_t)r * QKV_ROWS, g, t % (GROUP + 1), pos[r], rope_cs,
                                  layer_pool + g * BLOCK_ELEMS, ROW_TABLE(r), QK_W(layer), eps);
        }
        if (!all_arrived(sync, ++n, &spun)) return;
#ifdef MAX_POS  // a (row, kv head) at a time, each cached score computed once for its GROUP query heads
        for (int t = atomic_inc(heads_taken); t < nr * N_KV; t = atomic_inc(heads_taken)) {
            const int r = t / N_KV, g = t % N_KV;
            paged_attend_group(qkv, r, g, pos[r], layer_pool + g * BLOCK_ELEMS, ROW_TABLE(r), scale, scores, attn,
                               attn_sums);
        }
#else
        for (int t = atomic_inc(heads_taken); t < nr * N_HEADS; t = atomic_inc(heads_taken)) {
            const int r = t / N_HEADS, h = t % N_HEADS;
            paged_attend_row(qkv, r, h, pos[r], layer_pool + (h / GROUP) * BLOCK_ELEMS, ROW_TABLE(r), scale, attn,
                             attn_sums);
        }
#endif
        if (!all_arrived(sync, ++n, &spun)) return;

        // 3. the output projection into the residual
        LOAD_ROWS(attn, attn_sums, Q_DIM);
        GEMV_ROWS_N(tab[15], HIDDEN, Q_DIM, F32(5), F16(6), U8(7), x, HIDDEN, 1);
        if (!all_arrived(sync, ++n, &spun)) return;

        // 4. MLP RMSNorm of every row, gate|up
        for (int r = 0; r < nr; ++r) RMS_NORM_ROW(xr[r], xsr[r], x + (size_t)r * HIDDEN, F32(1), eps, HIDDEN);
        GEMV_ROWS_N(tab[16], 2 * FF, HIDDEN, F32(8), F16(9), U8(10), gu, 2 * FF, 0);
        if (!all_arrived(sync, ++n, &spun)) return;

        // 5. silu(gate) * up, a row's 32-block at a time
        for (int t = atomic_inc(blocks_taken); t < nr * (FF / 32); t = atomic_inc(blocks_taken)) {
            const int r = t / (FF / 32), b = t % (FF / 32);
            SILU_MUL_BLOCK(act_sums[(size_t)r * (FF / 32) + b], gu + (size_t)r * 2 * FF, gu + (size_t)r * 2 * FF + FF,
                           b, act + (size_t)r * FF);
        }
        if (!all_arrived(sync, ++n, &spun)) return;

        // 6. the down projection into the residual
        LOAD_ROWS(act, act_sums, FF);
        GEMV_ROWS_N(tab[17], HIDDEN, FF, F32(11), F16(12), U8(13), x, HIDDEN, 1);
    }
#undef ROW_TABLE
}
#endif
