"""One rank of the GPU matrix over MPI (``MpiBackend``, CUDA tensors staged through host
memory): ``mpiexec -n 4 python -m tests.gpu.mpi_matrix OUT`` writes every rank's results to
OUT (rank 0); a second argument ``cpu`` runs it on CPU tensors instead. Standalone and
``overlap=True`` only: the DDP hook needs a torch.distributed group. Started by
tests/gpu/test_multirank_gpu.py."""

from __future__ import annotations

import pickle
import sys

import torch

from commopt.comm import MpiBackend, set_default_backend
from tests.device_matrix import run_matrix


def main(out: str, device: str = "cuda") -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(0)
    backend = MpiBackend()
    set_default_backend(backend)
    mine = run_matrix(backend, device, modes=("standalone", "overlap"))
    everyone = backend.comm.gather(mine, root=0)
    if backend.rank == 0:
        with open(out, "wb") as f:
            pickle.dump(everyone, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
