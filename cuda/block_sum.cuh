// Shared by worker.cu and server.cu. NVRTC gets no include path: commopt.kernels.cuda_sources
// pastes this file in place of its #include line, so the text CuPy compiles (and caches by) is
// self-contained.
//
// Fixed-order fp64 reductions, and the norm finished by the last block of a launch: every block
// writes its partial sum, takes a ticket from a counter, and the block that takes the last
// ticket adds all partials in index order (the order does not depend on which block that is), so
// s and t cost one launch and no host round trip, and are the same bits whatever the schedule.

#define COMMOPT_THREADS 256

// Each warp's sum of v into sums[warp] (warp shuffles, a fixed order), then a barrier.
__device__ void commopt_warp_sums(double v, double* sums) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_down_sync(0xffffffffu, v, offset);
    }
    if ((threadIdx.x & 31) == 0) {
        sums[threadIdx.x >> 5] = v;
    }
    __syncthreads();
}

// Sum of v over the block, valid in thread 0 (fixed order: warp shuffles, then warps 0..7).
__device__ double commopt_block_sum(double v) {
    __shared__ double warp_sums[COMMOPT_THREADS / 32];
    commopt_warp_sums(v, warp_sums);
    double total = 0.0;
    if (threadIdx.x == 0) {
        for (int w = 0; w < COMMOPT_THREADS / 32; ++w) {
            total += warp_sums[w];
        }
    }
    return total;
}

// Sums of v over each half of the block (threads 0..127 and 128..255), valid in threads 0 and
// 128 respectively; fixed order as commopt_block_sum. The caller must __syncthreads() before
// calling it again (the shared warp sums are reused).
__device__ double commopt_half_block_sum(double v) {
    __shared__ double half_sums[COMMOPT_THREADS / 32];
    commopt_warp_sums(v, half_sums);
    double total = 0.0;
    if ((threadIdx.x & (COMMOPT_THREADS / 2 - 1)) == 0) {
        const int first = threadIdx.x >> 5;  // warp 0 or 4
        for (int w = first; w < first + COMMOPT_THREADS / 64; ++w) {
            total += half_sums[w];
        }
    }
    return total;
}

// out[0] = sqrt(sum(partial[0:count])) / sqrt(n), rounded once to fp32, by one whole block.
// partial is read volatile: in a last block it was written by other blocks of this launch.
__device__ void commopt_rms(const volatile double* partial, long long count, long long n,
                            float* out) {
    double acc = 0.0;
    for (long long i = threadIdx.x; i < count; i += blockDim.x) {
        acc += partial[i];
    }
    const double total = commopt_block_sum(acc);
    if (threadIdx.x == 0) {
        out[0] = n > 0 ? __double2float_rn(sqrt(total) / sqrt((double)n)) : 0.0f;
    }
}

// True in every thread of the block that finishes last. Call once per launch, after the block
// has written its partial sums; *done counts finished blocks and is 0 before the launch.
__device__ bool commopt_last_block(unsigned int* done) {
    __shared__ bool last;
    __threadfence();  // this block's partial sums are visible before its ticket is taken
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    return last;
}

// In the block that finishes last: out[0] = rms of the count partials, and *done back to 0 for
// the next launch on the same workspace.
__device__ void commopt_finish_if_last(double* partial, long long count, long long n,
                                       unsigned int* done, float* out) {
    if (commopt_last_block(done)) {
        __threadfence();
        commopt_rms(partial, count, n, out);
        if (threadIdx.x == 0) {
            *done = 0u;
        }
    }
}
