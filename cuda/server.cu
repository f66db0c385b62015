// Server side of the error-compensated 1-bit allreduce (commopt, SPEC §1 steps 6-7).
//
// commopt_server_average averages one range [lo, lo + length) of the server chunk f: for each
// element it reads the element's bit in each of the n received rows, adds the workers' ±s_i in
// rank order in fp32, divides by n, adds the server error and writes c_s back into f. The n·M
// unpacked values are never stored. Launched on the whole chunk (server_reduce_) it also
// finishes t = ‖c_s‖₂/√M in its last block; launched range by range (the pipelined allreduce's
// stages) it leaves that to commopt_finish_rms once every range is in. Either way the caller
// then packs and updates f in place (commopt_pack_update with c = e = f).
//
// One thread per byte of a row: thread x of a half block takes the 8 elements of byte x of its
// element block, so a warp reads 32 consecutive bytes of each row (one coalesced access per
// row) and f as two 16-byte vectors per thread.
//
// Partial sums per element block. The chunk is cut into blocks of COMMOPT_SERVER_BLOCK elements
// (the last one may be short), and partial[k] = Σ c_s² over element block k of the chunk, in
// fp64. Each half of a CUDA block (128 threads, 8 elements each) sums one element block in one
// fixed order: thread x adds the squares of its 8 elements in turn, then
// commopt_half_block_sum adds the threads' sums. That order depends on neither the grid nor the
// range the launch covers, so the chunk averaged in one launch (server_reduce_) or range by
// range (each starting at a multiple of COMMOPT_SERVER_BLOCK) gives the same partials, and
// commopt_rms adds them up to the same t, bit for bit. 1024 elements keep a small chunk on many
// CUDA blocks and divide the pipeline's stage alignment (4096).
//
// Exactness: the same fp32 operations in the same order as the CPU reference:
// acc = (((0 + v_0) + v_1) + ...), v_i = 2s_i·b − s_i; c_s = acc / n + f.
// Launch contract: blockDim.x == COMMOPT_THREADS; any grid size; lo a multiple of
// COMMOPT_SERVER_BLOCK; length a multiple of 8.

#include "block_sum.cuh"
#include "vector4.cuh"

#define COMMOPT_SERVER_BLOCK 1024

// recv: n rows of length / 8 packed bytes, row-major: row i holds worker i's signs for
// elements [lo, lo + length) of the chunk. scales: the n worker scales.
// f: the whole server chunk; elements [lo, lo + length) are overwritten with c_s.
// partial: one fp64 per element block of the whole chunk; this launch writes the entries of the
// element blocks in its range, partial[lo / COMMOPT_SERVER_BLOCK + b] for b = 0, 1, ...
// done, out: null for a range; for the whole chunk (lo = 0, length = M) *done is 0 and the
// last block writes out[0] = t and sets *done back to 0.
extern "C" __global__ void commopt_server_average(const unsigned char* __restrict__ recv,
                                                  const float* __restrict__ scales, int n,
                                                  long long lo, long long length,
                                                  float* __restrict__ f,
                                                  double* __restrict__ partial,
                                                  unsigned int* __restrict__ done,
                                                  float* __restrict__ out) {
    const long long row_bytes = length >> 3;
    const long long blocks = (length + COMMOPT_SERVER_BLOCK - 1) / COMMOPT_SERVER_BLOCK;
    const long long pairs = (blocks + 1) >> 1;
    const float n_f = (float)n;
    float* const range = f + lo;
    double* const range_partial = partial + lo / COMMOPT_SERVER_BLOCK;
    const bool vec = commopt_aligned16(range);
    const int half = threadIdx.x / (COMMOPT_THREADS / 2);
    const long long byte_in_block = threadIdx.x % (COMMOPT_THREADS / 2);
    // p depends on blockIdx only: every thread of the block takes the same trips.
    for (long long p = blockIdx.x; p < pairs; p += gridDim.x) {
        const long long b = 2 * p + half;                                  // element block
        const long long byte = b * (COMMOPT_SERVER_BLOCK / 8) + byte_in_block;  // of each row
        double acc_sq = 0.0;
        if (byte < row_bytes) {
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            for (int i = 0; i < n; ++i) {
                const float s = scales[i];
                const float plus = __fsub_rn(__fmul_rn(2.0f, s), s);
                const float minus = __fsub_rn(0.0f, s);
                const unsigned int bits = recv[(long long)i * row_bytes + byte];
                for (int k = 0; k < 8; ++k) {
                    acc[k] = __fadd_rn(acc[k], (bits >> (7 - k)) & 1u ? plus : minus);
                }
            }
            const float4 f0 = commopt_load4(range, 2 * byte, vec);
            const float4 f1 = commopt_load4(range, 2 * byte + 1, vec);
            const float4 c0 = make_float4(
                __fadd_rn(__fdiv_rn(acc[0], n_f), f0.x), __fadd_rn(__fdiv_rn(acc[1], n_f), f0.y),
                __fadd_rn(__fdiv_rn(acc[2], n_f), f0.z), __fadd_rn(__fdiv_rn(acc[3], n_f), f0.w));
            const float4 c1 = make_float4(
                __fadd_rn(__fdiv_rn(acc[4], n_f), f1.x), __fadd_rn(__fdiv_rn(acc[5], n_f), f1.y),
                __fadd_rn(__fdiv_rn(acc[6], n_f), f1.z), __fadd_rn(__fdiv_rn(acc[7], n_f), f1.w));
            commopt_store4(range, 2 * byte, c0, vec);
            commopt_store4(range, 2 * byte + 1, c1, vec);
            acc_sq = commopt_add_squares(commopt_add_squares(acc_sq, c0), c1);
        }
        const double total = commopt_half_block_sum(acc_sq);
        if (byte_in_block == 0 && b < blocks) {
            range_partial[b] = total;
        }
        // commopt_half_block_sum's shared warp sums are written again by the next pair of
        // element blocks: threads 0 and 128 must have read them first.
        __syncthreads();
    }
    if (done != nullptr) {
        commopt_finish_if_last(partial, blocks, length, done, out);
    }
}
