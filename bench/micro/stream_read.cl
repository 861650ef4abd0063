// The memory's yardstick for the GEMV benchmarks: each work-item sums one row of a large fp32
// buffer with 16-wide loads and two accumulators, the GEMVs' launch shape (one work-item a row)
// and their loads, with no arithmetic to speak of: bytes / time is what the device can stream.
__kernel void stream_read(__global const float *a, __global float *y, const int n16)
{
    const int o = get_global_id(0);
    __global const float *r = a + (size_t)o * n16 * 16;
    float16 s0 = (float16)(0.0f), s1 = s0;
    for (int i = 0; i + 2 <= n16; i += 2) {
        s0 += vload16(i, r);
        s1 += vload16(i + 1, r);
    }
    s0 += s1;
    const float8 s8 = s0.lo + s0.hi;
    const float4 s4 = s8.lo + s8.hi;
    y[o] = (s4.x + s4.y) + (s4.z + s4.w);
}
