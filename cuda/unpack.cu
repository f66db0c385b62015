// Final unpack of the error-compensated 1-bit allreduce (commopt, SPEC §1 step 9):
// out[q] = t_j·sgn(bit q) for the first n_true elements, straight into the output buffer.
//
// bits holds n rows of chunk_bytes bytes (row j from server j), so element q of the padded
// buffer is bit 7 - q % 8 of byte q / 8, and belongs to row j = q / (8 * chunk_bytes).
// The grid's y dimension walks the rows, so no thread divides by the chunk length.
// ±t is formed as the CPU reference forms it: 2t·1 − t and 2t·0 − t, in fp32.

extern "C" __global__ void commopt_unpack_scaled(const unsigned char* __restrict__ bits,
                                                 const float* __restrict__ scales, int n,
                                                 long long chunk_bytes, long long n_true,
                                                 float* __restrict__ out) {
    const long long chunk = 8 * chunk_bytes;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (int row = blockIdx.y; row < n; row += gridDim.y) {
        const long long lo = (long long)row * chunk;
        if (lo >= n_true) {
            break;
        }
        const long long hi = lo + chunk < n_true ? lo + chunk : n_true;
        const float t = scales[row];
        const float plus = __fsub_rn(__fmul_rn(2.0f, t), t);
        const float minus = __fsub_rn(0.0f, t);
        for (long long q = lo + (long long)blockIdx.x * blockDim.x + threadIdx.x; q < hi;
             q += stride) {
            const int bit = (bits[q >> 3] >> (7 - (int)(q & 7))) & 1;
            out[q] = bit ? plus : minus;
        }
    }
}
