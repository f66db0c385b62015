"""What the "DDP without commopt's hook" check costs: step() times of the first three steps
with the check (the first two communicating steps digest every gradient) and without it.

    python -m experiments.optim.ddp_check_cost

2 forked gloo ranks on loopback, the tcp benchmark's 25.2M-parameter MLP, 1-bit Adam in its
warmup; median over 3 fresh optimizers per row; rank 0's ms.
"""

import statistics
import time

import torch

import commopt
from experiments.tcp.bench import WideMLP
from tests.multirank.harness import run_ranks


def run(backend, check):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = WideMLP(1024, 4096, 1)
    g = torch.Generator().manual_seed(backend.rank)
    x, y = torch.randn(4, 1024, generator=g), torch.randn(4, 1024, generator=g)
    out = []
    for _ in range(3):
        opt = commopt.OnebitAdam(model.parameters(), lr=1e-6, freeze_step=100, backend=backend)
        if not check:
            opt._agreement.ddp_checks_left = 0
        ts = []
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            t = time.perf_counter()
            opt.step()
            ts.append(time.perf_counter() - t)
        out.append(ts)
    return [round(1e3 * statistics.median(o[k] for o in out), 1) for k in range(3)]


if __name__ == "__main__":
    for check in (True, False, True, False):
        print(
            "digest check" if check else "no check   ",
            run_ranks(run, 2, check, timeout=300)[0],
            "ms for steps 1, 2, 3",
        )
