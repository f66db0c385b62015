// Server side of the error-compensated 1-bit allreduce (commopt, SPEC §1 steps 6-7).
//
// One thread per element of the server chunk (M = 8 * chunk_bytes elements): it reads bit j of
// each of the n received rows, adds the workers' ±s_i in rank order in fp32, divides by n,
// adds the server error and writes c_s back into f. The n·M unpacked values are never stored.
// The caller then reduces the partial sums to t (commopt_finish_rms in worker.cu) and packs
// and updates f in place (commopt_pack_update with c = e = f).
//
// Exactness: the same fp32 operations in the same order as the CPU reference:
// acc = (((0 + v_0) + v_1) + ...), v_i = 2s_i·b − s_i; c_s = acc / n + f.
// Launch contract: blockDim.x == COMMOPT_THREADS; any grid size.

#include "block_sum.cuh"

// recv: n rows of chunk_bytes packed bytes (row i from worker i), row-major.
// scales: the n worker scales. f: the M-element server error, overwritten with c_s.
// partial[blockIdx.x] = sum of c_s^2 over the elements this block visited (fp64).
extern "C" __global__ void commopt_server_average(const unsigned char* __restrict__ recv,
                                                  const float* __restrict__ scales, int n,
                                                  long long chunk_bytes, float* __restrict__ f,
                                                  double* __restrict__ partial) {
    const long long m = 8 * chunk_bytes;
    const float n_f = (float)n;
    const long long stride = (long long)gridDim.x * blockDim.x;
    double acc_sq = 0.0;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < m; j += stride) {
        const long long byte = j >> 3;
        const int shift = 7 - (int)(j & 7);
        float acc = 0.0f;
        for (int i = 0; i < n; ++i) {
            const float s = scales[i];
            const float plus = __fsub_rn(__fmul_rn(2.0f, s), s);
            const float minus = __fsub_rn(0.0f, s);
            const int bit = (recv[(long long)i * chunk_bytes + byte] >> shift) & 1;
            acc = __fadd_rn(acc, bit ? plus : minus);
        }
        const float c_s = __fadd_rn(__fdiv_rn(acc, n_f), f[j]);
        f[j] = c_s;
        const double d = (double)c_s;
        acc_sq += d * d;
    }
    const double total = commopt_block_sum(acc_sq);
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = total;
    }
}
