// Shared by worker.cu and server.cu. NVRTC gets no include path: commopt.kernels.cuda_sources
// pastes this file in place of its #include line, so the text CuPy compiles (and caches by) is
// self-contained.

#define COMMOPT_THREADS 256

// Sum of v over the block, valid in thread 0 (fixed order: warp shuffles, then warps 0..7).
__device__ double commopt_block_sum(double v) {
    __shared__ double warp_sums[COMMOPT_THREADS / 32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_down_sync(0xffffffffu, v, offset);
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
        warp_sums[warp] = v;
    }
    __syncthreads();
    double total = 0.0;
    if (threadIdx.x == 0) {
        for (int w = 0; w < COMMOPT_THREADS / 32; ++w) {
            total += warp_sums[w];
        }
    }
    return total;
}
