// Work-group reductions of the GPU-shaped kernels (gemv_quant_wg.cl), which include this file;
// DeviceContext.build inlines it. WG: the work-group size, a power of two.
// Every lane calls them with its value and gets the work-group's result; red: WG floats of
// local memory, free again when they return.

inline float reduce_sum(__local float *red, const int lid, const float v)
{
    red[lid] = v;
    for (int s = WG / 2; s > 0; s >>= 1) {
        barrier(CLK_LOCAL_MEM_FENCE);
        if (lid < s) red[lid] += red[lid + s];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    const float out = red[0];
    barrier(CLK_LOCAL_MEM_FENCE);  // red is free again once every lane has read it
    return out;
}

inline float reduce_max(__local float *red, const int lid, const float v)
{
    red[lid] = v;
    for (int s = WG / 2; s > 0; s >>= 1) {
        barrier(CLK_LOCAL_MEM_FENCE);
        if (lid < s) red[lid] = fmax(red[lid], red[lid + s]);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    const float out = red[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return out;
}
