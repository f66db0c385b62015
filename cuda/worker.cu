// Worker side of the error-compensated 1-bit allreduce (commopt, SPEC §1 steps 1-4),
// plus the two helpers the server side reuses (finish_rms, pack_update).
//
// Exactness contract (commopt.kernels): every elementwise value is one correctly rounded fp32
// operation, written with the explicit __f*_rn intrinsics so that nvcc/NVRTC never contracts a
// multiply and an add into an FMA. ±s is formed exactly as the CPU reference forms it:
// 2s·1 − s and 2s·0 − s. Only the sums of squares are reduced in another order (in fp64).
//
// Launch contract: blockDim.x == COMMOPT_THREADS for the reducing kernels; any grid size.

#include "block_sum.cuh"

// c[i] = x[i] + e[i] for i < n_true, c[i] = e[i] for n_true <= i < n;
// partial[blockIdx.x] = sum of c[i]^2 over the elements this block visited (fp64).
extern "C" __global__ void commopt_compensate(const float* __restrict__ x, long long n_true,
                                              const float* __restrict__ e,
                                              float* __restrict__ c, long long n,
                                              double* __restrict__ partial) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    double acc = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float v = i < n_true ? __fadd_rn(x[i], e[i]) : e[i];
        c[i] = v;
        const double d = (double)v;
        acc += d * d;  // d*d is exact in fp64 (24-bit mantissas)
    }
    const double total = commopt_block_sum(acc);
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = total;
    }
}

// Like commopt_compensate without storing c: partial sums of (x[i] + e[i])^2 for i < n_true
// and of e[i]^2 for n_true <= i < n. c is recomputed (the same fp32 add) by
// commopt_pack_compensated, so an N-element temporary never exists.
extern "C" __global__ void commopt_scale(const float* __restrict__ x, long long n_true,
                                         const float* __restrict__ e, long long n,
                                         double* __restrict__ partial) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    double acc = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const double d = (double)(i < n_true ? __fadd_rn(x[i], e[i]) : e[i]);
        acc += d * d;
    }
    const double total = commopt_block_sum(acc);
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = total;
    }
}

// out[0] = sqrt(sum(partial[0:count])) / sqrt(n), rounded once to fp32. One block.
extern "C" __global__ void commopt_finish_rms(const double* __restrict__ partial, int count,
                                              long long n, float* __restrict__ out) {
    double acc = 0.0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        acc += partial[i];
    }
    const double total = commopt_block_sum(acc);
    if (threadIdx.x == 0) {
        out[0] = n > 0 ? __double2float_rn(sqrt(total) / sqrt((double)n)) : 0.0f;
    }
}

// bits = pack(c >= 0), most significant bit first (numpy packbits order);
// e[i] = c[i] - (c[i] >= 0 ? 2s - s : 0 - s), with s = s_ptr[0].
// n is a multiple of 8. c and e may be the same buffer (the server updates f in place), so
// neither is __restrict__: each thread reads c[i] before it writes e[i], and no other thread
// touches element i.
extern "C" __global__ void commopt_pack_update(const float* c, const float* __restrict__ s_ptr,
                                               float* e, unsigned char* __restrict__ bits,
                                               long long n) {
    const float s = s_ptr[0];
    const float plus = __fsub_rn(__fmul_rn(2.0f, s), s);
    const float minus = __fsub_rn(0.0f, s);
    const int lane = threadIdx.x & 31;
    const long long stride = (long long)gridDim.x * blockDim.x;  // a multiple of 32
    // The loop condition depends on the warp's first element only, so all 32 lanes stay
    // together for the ballot.
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i - lane < n;
         i += stride) {
        const bool valid = i < n;
        const float v = valid ? c[i] : 0.0f;
        const bool pos = v >= 0.0f;  // true for +0 and -0, false for NaN
        // Bit l of the ballot is lane l; reversed, lane l is bit 31 - l, so the byte of lanes
        // 8k..8k+7 with lane 8k as its most significant bit is (brev >> (24 - 8k)) & 0xff.
        const unsigned int ballot = __ballot_sync(0xffffffffu, valid && pos);
        if (valid) {
            e[i] = __fsub_rn(v, pos ? plus : minus);
            if ((lane & 7) == 0) {
                bits[i >> 3] = (unsigned char)((__brev(ballot) >> (24 - lane)) & 0xffu);
            }
        }
    }
}

// c = pad(x) + e computed on the fly (as in commopt_compensate), then exactly what
// commopt_pack_update does with it: bits = pack(c >= 0) MSB first; e[i] = c[i] - (±s).
// n is a multiple of 8; x holds the first n_true elements of the padded buffer.
extern "C" __global__ void commopt_pack_compensated(const float* __restrict__ x, long long n_true,
                                                    const float* __restrict__ s_ptr,
                                                    float* __restrict__ e,
                                                    unsigned char* __restrict__ bits,
                                                    long long n) {
    const float s = s_ptr[0];
    const float plus = __fsub_rn(__fmul_rn(2.0f, s), s);
    const float minus = __fsub_rn(0.0f, s);
    const int lane = threadIdx.x & 31;
    const long long stride = (long long)gridDim.x * blockDim.x;  // a multiple of 32
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i - lane < n;
         i += stride) {
        const bool valid = i < n;
        float v = 0.0f;
        if (valid) {
            v = i < n_true ? __fadd_rn(x[i], e[i]) : e[i];
        }
        const bool pos = v >= 0.0f;
        const unsigned int ballot = __ballot_sync(0xffffffffu, valid && pos);
        if (valid) {
            e[i] = __fsub_rn(v, pos ? plus : minus);
            if ((lane & 7) == 0) {
                bits[i >> 3] = (unsigned char)((__brev(ballot) >> (24 - lane)) & 0xffu);
            }
        }
    }
}
