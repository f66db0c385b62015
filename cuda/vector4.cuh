// Four consecutive fp32 elements at a time: one 16-byte load or store when the launch's
// pointers are all 16-byte aligned (the usual case: the caching allocator aligns to 512 bytes),
// four scalar accesses otherwise (a gradient view at an odd offset of a flat buffer). The
// choice is one flag per launch, so every thread of the grid takes the same branch.
//
// Pasted into worker.cu, server.cu and unpack.cu by commopt.kernels.cuda_sources.

__device__ __forceinline__ bool commopt_aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0ull;
}

// Elements 4q .. 4q + 3 of p.
__device__ __forceinline__ float4 commopt_load4(const float* p, long long q, bool vec) {
    if (vec) {
        return reinterpret_cast<const float4*>(p)[q];
    }
    const float* a = p + 4 * q;
    return make_float4(a[0], a[1], a[2], a[3]);
}

__device__ __forceinline__ void commopt_store4(float* p, long long q, float4 v, bool vec) {
    if (vec) {
        reinterpret_cast<float4*>(p)[q] = v;
        return;
    }
    float* a = p + 4 * q;
    a[0] = v.x;
    a[1] = v.y;
    a[2] = v.z;
    a[3] = v.w;
}

// acc + x² + y² + z² + w², in that order, in fp64 (each square exact: 24-bit mantissas).
__device__ __forceinline__ double commopt_add_squares(double acc, float4 v) {
    const double a = (double)v.x, b = (double)v.y, c = (double)v.z, d = (double)v.w;
    acc += a * a;
    acc += b * b;
    acc += c * c;
    acc += d * d;
    return acc;
}
