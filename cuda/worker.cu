// Worker side of the error-compensated 1-bit allreduce (commopt, SPEC §1 steps 1-4),
// plus the two helpers the server side reuses (finish_rms, pack_update).
//
// Exactness contract (commopt.kernels): every elementwise value is one correctly rounded fp32
// operation, written with the explicit __f*_rn intrinsics so that nvcc/NVRTC never contracts a
// multiply and an add into an FMA. ±s is formed exactly as the CPU reference forms it:
// 2s·1 − s and 2s·0 − s. Only the sums of squares are reduced in another order (in fp64).
//
// One pass each, at the memory bandwidth: a thread takes 4 consecutive elements per trip of its
// grid-stride loop (16-byte loads and stores, vector4.cuh), and the two norm kernels finish
// s = ‖c‖₂/√N in their last block (block_sum.cuh): one launch, no second kernel.
//
// Launch contract: blockDim.x == COMMOPT_THREADS for every kernel here; any grid size; for the
// norm kernels, partial holds gridDim.x doubles and *done is 0 (it is 0 again afterwards).

#include "block_sum.cuh"
#include "vector4.cuh"

// c = pad(x) + e on elements 4q .. 4q + 3: x[i] + e[i] for i < n_true, e[i] past it.
__device__ __forceinline__ float4 commopt_compensated4(const float* x, long long n_true,
                                                       const float* e, long long q, bool vec) {
    const float4 ev = commopt_load4(e, q, vec);
    const long long i = 4 * q;
    if (i + 4 <= n_true) {
        const float4 xv = commopt_load4(x, q, vec);
        return make_float4(__fadd_rn(xv.x, ev.x), __fadd_rn(xv.y, ev.y), __fadd_rn(xv.z, ev.z),
                           __fadd_rn(xv.w, ev.w));
    }
    if (i >= n_true) {
        return ev;
    }
    // The quad that straddles n_true: x has no element past it, so no vector load of x.
    float4 v = ev;
    v.x = __fadd_rn(x[i], ev.x);
    if (i + 1 < n_true) v.y = __fadd_rn(x[i + 1], ev.y);
    if (i + 2 < n_true) v.z = __fadd_rn(x[i + 2], ev.z);
    return v;
}

__device__ __forceinline__ float commopt_compensated1(const float* x, long long n_true,
                                                      const float* e, long long i) {
    return i < n_true ? __fadd_rn(x[i], e[i]) : e[i];
}

// c[i] = x[i] + e[i] for i < n_true, c[i] = e[i] for n_true <= i < n;
// out[0] = ‖c‖₂/√n, reduced in fp64 and finished by the last block.
extern "C" __global__ void commopt_compensate(const float* __restrict__ x, long long n_true,
                                              const float* __restrict__ e,
                                              float* __restrict__ c, long long n,
                                              double* __restrict__ partial,
                                              unsigned int* __restrict__ done,
                                              float* __restrict__ out) {
    const bool vec = commopt_aligned16(x) && commopt_aligned16(e) && commopt_aligned16(c);
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long quads = n >> 2;
    double acc = 0.0;
    for (long long q = first; q < quads; q += stride) {
        const float4 v = commopt_compensated4(x, n_true, e, q, vec);
        commopt_store4(c, q, v, vec);
        acc = commopt_add_squares(acc, v);
    }
    for (long long i = 4 * quads + first; i < n; i += stride) {  // n % 4 leftovers
        const float v = commopt_compensated1(x, n_true, e, i);
        c[i] = v;
        const double d = (double)v;
        acc += d * d;
    }
    const double total = commopt_block_sum(acc);
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = total;
    }
    commopt_finish_if_last(partial, gridDim.x, n, done, out);
}

// Like commopt_compensate without storing c: out[0] = ‖pad(x) + e‖₂/√n. c is recomputed (the
// same fp32 add) by commopt_pack_compensated, so an N-element temporary never exists.
extern "C" __global__ void commopt_scale(const float* __restrict__ x, long long n_true,
                                         const float* __restrict__ e, long long n,
                                         double* __restrict__ partial,
                                         unsigned int* __restrict__ done,
                                         float* __restrict__ out) {
    const bool vec = commopt_aligned16(x) && commopt_aligned16(e);
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long quads = n >> 2;
    double acc = 0.0;
    for (long long q = first; q < quads; q += stride) {
        acc = commopt_add_squares(acc, commopt_compensated4(x, n_true, e, q, vec));
    }
    for (long long i = 4 * quads + first; i < n; i += stride) {
        const double d = (double)commopt_compensated1(x, n_true, e, i);
        acc += d * d;
    }
    const double total = commopt_block_sum(acc);
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = total;
    }
    commopt_finish_if_last(partial, gridDim.x, n, done, out);
}

// out[0] = sqrt(sum(partial[0:count])) / sqrt(n), rounded once to fp32. One block. Used by the
// staged server step, whose partial sums come from several launches.
extern "C" __global__ void commopt_finish_rms(const double* __restrict__ partial, long long count,
                                              long long n, float* __restrict__ out) {
    commopt_rms(partial, count, n, out);
}

// The 4 sign bits of v (c >= 0: true for +0 and -0, false for NaN), element 4q first (MSB), and
// e's four new values c − (±s).
__device__ __forceinline__ unsigned int commopt_signs4(float4 v, float plus, float minus,
                                                       float4* e) {
    const bool px = v.x >= 0.0f, py = v.y >= 0.0f, pz = v.z >= 0.0f, pw = v.w >= 0.0f;
    *e = make_float4(__fsub_rn(v.x, px ? plus : minus), __fsub_rn(v.y, py ? plus : minus),
                     __fsub_rn(v.z, pz ? plus : minus), __fsub_rn(v.w, pw ? plus : minus));
    return (px ? 8u : 0u) | (py ? 4u : 0u) | (pz ? 2u : 0u) | (pw ? 1u : 0u);
}

// Byte q / 2 of the packed bits is lane pair (q, q + 1)'s nibbles, the even lane's first: the
// even lane takes its neighbour's nibble with one shuffle and stores the byte. The loop
// condition depends on the warp's first quad only, so all 32 lanes stay together for the
// shuffle; quads (n / 4) is even, so a valid even q always has a valid q + 1.
__device__ __forceinline__ void commopt_store_byte(unsigned char* bits, long long q, bool valid,
                                                   unsigned int nibble) {
    const unsigned int next = __shfl_down_sync(0xffffffffu, nibble, 1);
    if (valid && (q & 1) == 0) {
        bits[q >> 1] = (unsigned char)((nibble << 4) | next);
    }
}

// bits = pack(c >= 0), most significant bit first (numpy packbits order);
// e[i] = c[i] - (c[i] >= 0 ? 2s - s : 0 - s), with s = s_ptr[0].
// n is a multiple of 8. c and e may be the same buffer (the server updates f in place), so
// neither is __restrict__: each thread reads c's elements before it writes e's, and no other
// thread touches them.
extern "C" __global__ void commopt_pack_update(const float* c, const float* __restrict__ s_ptr,
                                               float* e, unsigned char* __restrict__ bits,
                                               long long n) {
    const float s = s_ptr[0];
    const float plus = __fsub_rn(__fmul_rn(2.0f, s), s);
    const float minus = __fsub_rn(0.0f, s);
    const bool vec = commopt_aligned16(c) && commopt_aligned16(e);
    const int lane = threadIdx.x & 31;
    const long long quads = n >> 2;
    const long long stride = (long long)gridDim.x * blockDim.x;  // a multiple of 32
    for (long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x; q - lane < quads;
         q += stride) {
        const bool valid = q < quads;
        unsigned int nibble = 0u;
        if (valid) {
            float4 updated;
            nibble = commopt_signs4(commopt_load4(c, q, vec), plus, minus, &updated);
            commopt_store4(e, q, updated, vec);
        }
        commopt_store_byte(bits, q, valid, nibble);
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
    const bool vec = commopt_aligned16(x) && commopt_aligned16(e);
    const int lane = threadIdx.x & 31;
    const long long quads = n >> 2;
    const long long stride = (long long)gridDim.x * blockDim.x;  // a multiple of 32
    for (long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x; q - lane < quads;
         q += stride) {
        const bool valid = q < quads;
        unsigned int nibble = 0u;
        if (valid) {
            float4 updated;
            nibble = commopt_signs4(commopt_compensated4(x, n_true, e, q, vec), plus, minus,
                                    &updated);
            commopt_store4(e, q, updated, vec);
        }
        commopt_store_byte(bits, q, valid, nibble);
    }
}
