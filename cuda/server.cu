// Server side of the error-compensated 1-bit allreduce (commopt, SPEC §1 steps 6-7).
//
// commopt_server_average averages one range [lo, lo + length) of the server chunk f: for each
// element it reads the element's bit in each of the n received rows, adds the workers' ±s_i in
// rank order in fp32, divides by n, adds the server error and writes c_s back into f. The n·M
// unpacked values are never stored. The caller then reduces the partial sums to t
// (commopt_finish_rms in worker.cu) and packs and updates f in place (commopt_pack_update with
// c = e = f, on the whole chunk or range by range).
//
// Partial sums per element block. The chunk is cut into blocks of COMMOPT_SERVER_BLOCK elements
// (the last one may be short), and partial[k] = Σ c_s² over element block k of the chunk, in
// fp64. One CUDA block sums one element block in one fixed order: thread x adds the squares of
// elements x, x + 256, x + 512, x + 768 of the element block in turn, then commopt_block_sum adds the
// threads' sums. That order depends on neither the grid nor the range the launch covers, so the
// chunk averaged in one launch (server_reduce_) or range by range (the pipelined allreduce's
// stages, each starting at a multiple of COMMOPT_SERVER_BLOCK) gives the same partials, and
// commopt_finish_rms adds them up to the same t, bit for bit. 1024 elements (4 per thread) keep
// a small chunk on many CUDA blocks and divide the pipeline's stage alignment (4096).
//
// Exactness: the same fp32 operations in the same order as the CPU reference:
// acc = (((0 + v_0) + v_1) + ...), v_i = 2s_i·b − s_i; c_s = acc / n + f.
// Launch contract: blockDim.x == COMMOPT_THREADS; any grid size; lo a multiple of
// COMMOPT_SERVER_BLOCK; length a multiple of 8.

#include "block_sum.cuh"

#define COMMOPT_SERVER_BLOCK 1024

// recv: n rows of length / 8 packed bytes, row-major: row i holds worker i's signs for
// elements [lo, lo + length) of the chunk. scales: the n worker scales.
// f: the whole server chunk; elements [lo, lo + length) are overwritten with c_s.
// partial: one fp64 per element block of the whole chunk; this launch writes the entries of the
// element blocks in its range, partial[lo / COMMOPT_SERVER_BLOCK + b] for b = 0, 1, ...
extern "C" __global__ void commopt_server_average(const unsigned char* __restrict__ recv,
                                                  const float* __restrict__ scales, int n,
                                                  long long lo, long long length,
                                                  float* __restrict__ f,
                                                  double* __restrict__ partial) {
    const long long row_bytes = length >> 3;
    const long long blocks = (length + COMMOPT_SERVER_BLOCK - 1) / COMMOPT_SERVER_BLOCK;
    const float n_f = (float)n;
    float* const range = f + lo;
    double* const range_partial = partial + lo / COMMOPT_SERVER_BLOCK;
    // b depends on blockIdx only: every thread of the block takes the same trips.
    for (long long b = blockIdx.x; b < blocks; b += gridDim.x) {
        const long long first = b * COMMOPT_SERVER_BLOCK;
        const long long end =
            first + COMMOPT_SERVER_BLOCK < length ? first + COMMOPT_SERVER_BLOCK : length;
        double acc_sq = 0.0;
        // j indexes the range (and recv's rows); element lo + j of the chunk.
        for (long long j = first + threadIdx.x; j < end; j += blockDim.x) {
            const long long byte = j >> 3;
            const int shift = 7 - (int)(j & 7);
            float acc = 0.0f;
            for (int i = 0; i < n; ++i) {
                const float s = scales[i];
                const float plus = __fsub_rn(__fmul_rn(2.0f, s), s);
                const float minus = __fsub_rn(0.0f, s);
                const int bit = (recv[(long long)i * row_bytes + byte] >> shift) & 1;
                acc = __fadd_rn(acc, bit ? plus : minus);
            }
            const float c_s = __fadd_rn(__fdiv_rn(acc, n_f), range[j]);
            range[j] = c_s;
            const double d = (double)c_s;
            acc_sq += d * d;
        }
        const double total = commopt_block_sum(acc_sq);
        if (threadIdx.x == 0) {
            range_partial[b] = total;
        }
        // commopt_block_sum's shared warp sums are written again by the next element block:
        // thread 0 must have read them first.
        __syncthreads();
    }
}
