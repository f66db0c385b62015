"""Do the options beyond the papers pay? Auto freeze, tracking trust ratios, EControl, the
step guard.

Importing the package caps torch's CPU kernels at AVX2 (:mod:`experiments.cpu_isa`) before any
of its modules loads torch: the losses these experiments report move with an ulp."""

from experiments.cpu_isa import cap_at_avx2

cap_at_avx2()
