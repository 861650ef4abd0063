// The parts some architectures add to Llama's layer (services/model/architecture.py), one small
// launch each, one work-item per row (or per (row, head) / (row, block)): LayerNorm, bias adds,
// per-head RMSNorm of q and k, the GELU MLP's activation, learned position embeddings.
// The engine launches them only for an architecture that has the part (plans.py, paged_plans.py).
// Defines: HEAD_DIM, Q_DIM, KV_DIM.

#define QKV_ROW (Q_DIM + 2 * KV_DIM)

// LayerNorm: out = (x - mean) * rsqrt(var + eps) * w + b, var the mean of squared deviations (torch's
// biased variance), in fp32; out_sums[r, b] = sum of out[r, 32 b : 32 b + 32] as rms_norm writes them
// (a Q4_1 GEMV of one row reads them). n % 4 == 0.
__kernel void layer_norm(__global const float *x, __global const float *w, __global const float *bias,
                         __global float *out, __global float *out_sums, const int n, const float eps)
{
    const int r = get_global_id(0), nb = (n + 31) / 32;
    __global const float *xr = x + (size_t)r * n;
    __global float *outr = out + (size_t)r * n;
    float4 acc = (float4)(0.0f);
    for (int i = 0; i < n / 4; ++i) acc += vload4(i, xr);
    const float mean = (acc.x + acc.y + acc.z + acc.w) / n;
    float4 sq = (float4)(0.0f);
    for (int i = 0; i < n / 4; ++i) { const float4 d = vload4(i, xr) - mean; sq = fma(d, d, sq); }
    const float scale = rsqrt((sq.x + sq.y + sq.z + sq.w) / n + eps);
    for (int b = 0; b < nb; ++b) {
        float4 s = (float4)(0.0f);
        for (int i = 8 * b; i < min(8 * b + 8, n / 4); ++i) {
            const float4 v = fma((vload4(i, xr) - mean) * scale, vload4(i, w), vload4(i, bias));
            vstore4(v, i, outr);
            s += v;
        }
        out_sums[(size_t)r * nb + b] = (s.x + s.y) + (s.z + s.w);
    }
}

// y[r, c] += bias[c] for c < cols: a projection's bias, after its GEMV wrote (or added into) y
__kernel void add_bias(__global float *y, __global const float *bias, const int cols)
{
    __global float *yr = y + (size_t)get_global_id(0) * cols;
    for (int c = 0; c < cols; ++c) yr[c] += bias[c];
}

// RMSNorm of each q and k head of a q|k|v row, in place (Qwen3's q_norm, k_norm: weights [HEAD_DIM]),
// before RoPE. Work-item (r, h): h < Q_DIM / HEAD_DIM a query head, then the key heads.
__kernel void head_rms_norm(__global float *qkv, __global const float *q_w, __global const float *k_w,
                            const float eps)
{
    const int r = get_global_id(0), h = get_global_id(1);
    __global float *v = qkv + (size_t)r * QKV_ROW + (size_t)h * HEAD_DIM;  // k heads follow the q heads
    __global const float *w = h < Q_DIM / HEAD_DIM ? q_w : k_w;
    float4 acc = (float4)(0.0f);
    for (int i = 0; i < HEAD_DIM / 4; ++i) { const float4 x = vload4(i, v); acc = fma(x, x, acc); }
    const float scale = rsqrt((acc.x + acc.y + acc.z + acc.w) / HEAD_DIM + eps);
    for (int i = 0; i < HEAD_DIM / 4; ++i) vstore4(vload4(i, w) * (vload4(i, v) * scale), i, v);
}

// act[r, i] = gelu_tanh(up[r, i]) (GPT-2's "gelu_new"), up: [rows, ff]; work-item (r, b) makes the
// 32-block b and its sum act_sums[r, b] (silu_mul's layout, for the down projection's GEMV)
__kernel void gelu_rows(__global const float *up, __global float *act, __global float *act_sums, const int ff)
{
    const int r = get_global_id(0), b = get_global_id(1), nb = (ff + 31) / 32;
    __global const float *u = up + (size_t)r * ff;
    float s = 0.0f;
    for (int i = 32 * b; i < min(32 * b + 32, ff); ++i) {
        const float x = u[i];
        const float a = 0.5f * x * (1.0f + tanh(0.7978845608028654f * (x + 0.044715f * (x * x * x))));
        act[(size_t)r * ff + i] = a;
        s += a;
    }
    act_sums[(size_t)r * nb + b] = s;
}

// x[r, :] += table[pos[r], :]: learned absolute position embeddings, after the token embedding
__kernel void add_positions(__global float *x, __global const float *table, __global const int *pos,
                            const int hidden)
{
    const int r = get_global_id(0);
    __global float *xr = x + (size_t)r * hidden;
    __global const float *t = table + (size_t)pos[r] * hidden;
    for (int c = 0; c < hidden; ++c) xr[c] += t[c];
}
