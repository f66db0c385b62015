// Final unpack of the error-compensated 1-bit allreduce (commopt, SPEC §1 step 9):
// out[q] = t_j·sgn(bit q) for the first n_true elements, straight into the output buffer.
//
// bits holds n rows of chunk_bytes bytes (row j from server j), so element q of the padded
// buffer is bit 7 - q % 8 of byte q / 8, and belongs to row j = q / (8 * chunk_bytes).
// The grid's y dimension walks the rows, so no thread divides by the chunk length. One thread
// per byte: a warp reads 32 consecutive bytes and writes each byte's 8 floats as two 16-byte
// vectors (vector4.cuh), except in the byte that straddles n_true.
// ±t is formed as the CPU reference forms it: 2t·1 − t and 2t·0 − t, in fp32.

#include "vector4.cuh"

extern "C" __global__ void commopt_unpack_scaled(const unsigned char* __restrict__ bits,
                                                 const float* __restrict__ scales, int n,
                                                 long long chunk_bytes, long long n_true,
                                                 float* __restrict__ out) {
    const long long chunk = 8 * chunk_bytes;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const bool vec = commopt_aligned16(out);  // row starts are multiples of 8 elements
    for (int row = blockIdx.y; row < n; row += gridDim.y) {
        const long long lo = (long long)row * chunk;
        if (lo >= n_true) {
            break;
        }
        const long long hi = lo + chunk < n_true ? lo + chunk : n_true;
        const long long row_end = (hi - lo + 7) >> 3;  // bytes of this row that hold elements
        const float t = scales[row];
        const float plus = __fsub_rn(__fmul_rn(2.0f, t), t);
        const float minus = __fsub_rn(0.0f, t);
        for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < row_end;
             k += stride) {
            const unsigned int byte = bits[row * chunk_bytes + k];
            float v[8];
            for (int j = 0; j < 8; ++j) {
                v[j] = (byte >> (7 - j)) & 1u ? plus : minus;
            }
            const long long q = lo + 8 * k;  // first element of this byte
            if (q + 8 <= hi) {
                commopt_store4(out, q >> 2, make_float4(v[0], v[1], v[2], v[3]), vec);
                commopt_store4(out, (q >> 2) + 1, make_float4(v[4], v[5], v[6], v[7]), vec);
            } else {
                for (int j = 0; q + j < hi; ++j) {
                    out[q + j] = v[j];
                }
            }
        }
    }
}
