"""Where the DDP hook's extra time per step goes, against the standalone optimizer (issue #23.3).

    python -m experiments.optim.profile_ddp_hook          # per-step forward/backward/step() ms
    python -m experiments.optim.profile_ddp_hook prof     # and a cProfile of rank 0

Two forked gloo ranks on loopback, the tcp benchmark's 25.2M-parameter WideMLP, 1-bit Adam in
its compression stage, three ways in one run, twice: the standalone optimizer, DDP with
commopt's hook, and DDP with the hook and ``gradient_as_bucket_view=True``.
"""

import cProfile
import io
import pstats
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

import commopt
from experiments.tcp.bench import WideMLP
from tests.multirank.harness import run_ranks


def run(backend, mode, prof):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = WideMLP(1024, 4096, 1)
    m = (
        DistributedDataParallel(model, gradient_as_bucket_view=mode.endswith("view"))
        if mode.startswith("ddp")
        else model
    )
    opt = commopt.OnebitAdam(m.parameters(), lr=1e-6, freeze_step=2, backend=backend)
    if mode.startswith("ddp"):
        m.register_comm_hook(commopt.ddp.OnebitHookState(opt), commopt.ddp.onebit_hook)
    if "late" in mode:  # the hook leaves the compression stage's exchange to step()
        opt.early_work.decline()
    g = torch.Generator().manual_seed(backend.rank)
    x, y = torch.randn(4, 1024, generator=g), torch.randn(4, 1024, generator=g)
    times = []
    pr = cProfile.Profile()
    for step in range(8):
        t0 = time.perf_counter()
        if step >= 4 and prof and backend.rank == 0:
            pr.enable()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if step >= 4 and prof and backend.rank == 0:
            pr.disable()
        times.append((t1 - t0, t2 - t1, t3 - t2))
    out = ""
    if prof and backend.rank == 0:
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        out = s.getvalue()
    return [tuple(round(1e3 * v) for v in t) for t in times[4:]], out


if __name__ == "__main__":
    prof = len(sys.argv) > 1
    for mode in ("standalone", "ddp", "ddp-view", "ddp-late", "ddp-late-view") * 2:
        r = run_ranks(run, 2, mode, prof, timeout=300)
        print(mode, "fwd/bwd/step ms:", r[0][0])
        if prof:
            print(r[0][1])
