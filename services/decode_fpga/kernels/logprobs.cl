// Log-probabilities of logit rows on the device (services/decode_fpga/device_logprobs.py): the
// row's log-sum-exp, the logprob of one token of the row, and its k most likely (id, logprob),
// so a step with logprobs reads back 2 + 2k words a row instead of the vocabulary's floats.
// The same numbers as services/engine/logprobs.py's token_logprob (ties: the lower id first).
//
// LP_WG: work-items per row (one work-group a row); TOPK_MAX: the largest k (logprobs.py's 20).
//
// out[r, :] (stride 2 + 2k, 32-bit words): the row's argmax (its best id: the first index of the
// max, as argmax_rows picks, so a greedy step needs no argmax launch beside this one), the target's
// logprob (float bits), the top k ids, their logprobs (float bits). The target is targets[r], or the
// argmax when that is negative (a greedy row's pick). Logits are finite (raw model logits: no masks).

// (v, i) ranks before (w, j): the larger logit, or the lower id on a tie
#define RANKS_BEFORE(v, i, w, j) ((v) > (w) || ((v) == (w) && (i) < (j)))

__kernel void logprobs_rows(__global const float *logits, const int vocab, __global const int *targets,
                            const int k, __global int *out)
{
    // each work-item's own top k, best first, then its chunk's max and sum of exp(x - max)
    __local float top_v[LP_WG * TOPK_MAX];
    __local int top_i[LP_WG * TOPK_MAX];
    __local float part_max[LP_WG], part_sum[LP_WG];
    __local int head[LP_WG];
    const int r = get_group_id(0), lid = get_local_id(0);
    __global const float *row = logits + (size_t)r * vocab;
    // contiguous chunks in id order (a multiple of 8 long): a work-item scans its own cache lines,
    // and equal logits in two chunks keep the lower id ahead
    const int chunk = (vocab + 8 * LP_WG - 1) / (8 * LP_WG) * 8;
    const int start = min(lid * chunk, vocab), end = min(start + chunk, vocab);
    __local float *tv = top_v + lid * TOPK_MAX;
    __local int *ti = top_i + lid * TOPK_MAX;
    const int kk = max(k, 1);  // the lists hold at least the best: the argmax
    for (int j = 0; j < kk; ++j) {
        tv[j] = -INFINITY;
        ti[j] = vocab;  // after any real id
    }
    // pass 1: the chunk's max (8 lanes) and its top k (an insertion, rare once the list is good)
    float8 m8 = (float8)(-INFINITY);
    float kth = -INFINITY;  // the k-th best so far: only a strictly larger logit enters (ids ascend)
    for (int i = start; i < end; i += 8) {
        const int n = min(8, end - i);
        float8 v;
        if (n == 8) {
            v = vload8(0, row + i);
        } else {
            float t[8];
            for (int q = 0; q < 8; ++q) t[q] = q < n ? row[i + q] : -INFINITY;
            v = vload8(0, t);
        }
        m8 = fmax(m8, v);
        if (any(isgreater(v, (float8)(kth)))) {
            const float vs[8] = {v.s0, v.s1, v.s2, v.s3, v.s4, v.s5, v.s6, v.s7};
            for (int q = 0; q < n; ++q) {
                const float x = vs[q];
                if (!(x > tv[kk - 1])) continue;
                int p = kk - 1;
                while (p > 0 && x > tv[p - 1]) {  // an equal logit before it has a lower id: it stays ahead
                    tv[p] = tv[p - 1];
                    ti[p] = ti[p - 1];
                    --p;
                }
                tv[p] = x;
                ti[p] = i + q;
            }
            kth = tv[kk - 1];
        }
    }
    float m = fmax(fmax(fmax(m8.s0, m8.s1), fmax(m8.s2, m8.s3)), fmax(fmax(m8.s4, m8.s5), fmax(m8.s6, m8.s7)));
    // pass 2: sum of exp(x - m) over the chunk (in cache now)
    float8 s8 = (float8)(0.0f);
    int i = start;
    for (; i + 8 <= end; i += 8) s8 += exp(vload8(0, row + i) - (float8)(m));
    float s = s8.s0 + s8.s1 + s8.s2 + s8.s3 + s8.s4 + s8.s5 + s8.s6 + s8.s7;
    for (; i < end; ++i) s += exp(row[i] - m);
    part_max[lid] = m;
    part_sum[lid] = s;
    head[lid] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid != 0) return;
    // work-item 0: the row's log-sum-exp from the chunks' (max, sum) pairs
    float big = -INFINITY;
    for (int w = 0; w < LP_WG; ++w) big = fmax(big, part_max[w]);
    float total = 0.0f;
    for (int w = 0; w < LP_WG; ++w) {
        if (part_max[w] > -INFINITY) total += part_sum[w] * exp(part_max[w] - big);
    }
    const float lse = big + log(total);
    __global int *o = out + (size_t)r * (2 + 2 * k);
    // the kk best of the chunks' lists: a k-way merge, the best head taken kk times
    for (int j = 0; j < kk; ++j) {
        int best = -1;
        float bv = -INFINITY;
        int bi = vocab + 1;
        for (int w = 0; w < LP_WG; ++w) {
            const int h = head[w];
            if (h >= kk) continue;
            const float v = top_v[w * TOPK_MAX + h];
            const int id = top_i[w * TOPK_MAX + h];
            if (RANKS_BEFORE(v, id, bv, bi)) {
                bv = v;
                bi = id;
                best = w;
            }
        }
        head[best] += 1;
        if (j == 0) {
            const int target = targets[r] >= 0 ? targets[r] : bi;
            o[0] = bi;
            o[1] = as_int(row[target] - lse);
        }
        if (j < k) {
            o[2 + j] = bi;
            o[2 + k + j] = as_int(bv - lse);
        }
    }
}
