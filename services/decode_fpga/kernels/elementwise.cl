// Small element-wise and reduction kernels of a decode step.

// act[r, i] = silu(gu[r, i]) * gu[r, FF + i]   gu: [rows, 2 FF] (gate | up), act: [rows, FF]
__kernel void silu_mul(__global const float *gu, __global float *act, const int ff)
{
    const int r = get_global_id(0), i = get_global_id(1);
    const float g = gu[(size_t)r * 2 * ff + i];
    act[(size_t)r * ff + i] = g / (1.0f + exp(-g)) * gu[(size_t)r * 2 * ff + ff + i];
}

// out[r] = the first index of the largest logits[r, :]; one work-group of ARGMAX_WG per row.
__kernel void argmax_rows(__global const float *logits, const int vocab, __global int *out)
{
    __local float best_v[ARGMAX_WG];
    __local int best_i[ARGMAX_WG];
    const int r = get_group_id(0), lid = get_local_id(0);
    __global const float *row = logits + (size_t)r * vocab;
    float bv = -INFINITY;
    int bi = vocab;
    for (int i = lid; i < vocab; i += ARGMAX_WG) {
        const float v = row[i];
        if (v > bv) { bv = v; bi = i; }  // ascending i per item: the first max is kept
    }
    best_v[lid] = bv;
    best_i[lid] = bi;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = ARGMAX_WG / 2; s > 0; s >>= 1) {
        if (lid < s) {
            const float ov = best_v[lid + s];
            const int oi = best_i[lid + s];
            if (ov > best_v[lid] || (ov == best_v[lid] && oi < best_i[lid])) { best_v[lid] = ov; best_i[lid] = oi; }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) out[r] = best_i[0];
}
