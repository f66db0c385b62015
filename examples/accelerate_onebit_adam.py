"""accelerate with ``commopt.OnebitAdam`` through the DDP hook: a small regression, 2 ranks.

    torchrun --nproc_per_node 2 examples/accelerate_onebit_adam.py --out /tmp/acc-run

``accelerator.prepare`` wraps the model in DistributedDataParallel (and the optimizer in an
``AcceleratedOptimizer``). Register ``commopt.ddp.onebit_hook`` on the DDP model, paired with
the commopt optimizer you built (not the wrapper). ``accelerator.accumulate`` runs DDP's
``no_sync()`` on every backward pass but the last of a step, so those communicate nothing.
Rank 0 writes ``result.json`` (losses, ``comm_stats()``, whether the replicas are identical).

With ``--diloco H`` the optimizer is ``commopt.DiLoCo`` around ``torch.optim.AdamW``, and the
hook registered is torch's ``noop_hook``: the inner steps keep each rank's own gradients and
DiLoCo averages the pseudo-gradient every H steps. (``result.json`` then also records whether
DiLoCo warned that the ranks ran in lockstep, which they must not.)

Checkpoints: ``--save-at K`` calls ``accelerator.save_state(OUT/step-K)`` after step K, and
``commopt.save_checkpoint`` beside it (``OUT/step-K/commopt``): ``save_state`` writes the
optimizer state of the main process alone, and every rank's own error buffers (and, under
DiLoCo, its weights and inner state between syncs) are ``commopt.save_checkpoint``'s to keep.
``--resume OUT/step-K`` loads both, in that order, and goes on from step K + 1.
"""

import argparse
import hashlib
import json
import os
import warnings

import torch
import torch.distributed as dist
from accelerate import Accelerator

import commopt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--freeze-step", type=int, default=10)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--diloco", type=int, default=0, help="H: commopt.DiLoCo around AdamW")
    parser.add_argument("--out", default="acc-run")
    parser.add_argument("--save-at", type=int, default=0, help="a checkpoint after step K")
    parser.add_argument("--resume", help="a folder --save-at wrote")
    args = parser.parse_args()
    torch.set_num_threads(1)

    accelerator = Accelerator(gradient_accumulation_steps=args.accumulation, cpu=True)
    torch.manual_seed(0)  # same weights and target everywhere; data differ by rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    target = torch.randn(8, 1)
    if args.diloco:  # collective: after Accelerator(), which starts the process group
        opt = commopt.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=args.diloco)
    else:
        opt = commopt.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=args.freeze_step)
    model, wrapped = accelerator.prepare(model, opt)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        commopt.ddp.register_hook(model, opt)  # for DiLoCo torch's noop_hook: local inner steps
    gen = torch.Generator().manual_seed(1 + accelerator.process_index)
    step = 0
    if args.resume:  # accelerate's state, then every rank's own over the main process's
        accelerator.load_state(args.resume)
        step = commopt.load_checkpoint(os.path.join(args.resume, "commopt"), model, opt)["step"]
        for _ in range(step * args.accumulation):  # the batches the saved run had drawn
            torch.randn(16, 8, generator=gen)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        losses = []
        for _ in range(step * args.accumulation, args.steps * args.accumulation):
            x = torch.randn(16, 8, generator=gen)
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), x @ target)
                accelerator.backward(loss)
                wrapped.step()
                wrapped.zero_grad()
            if accelerator.sync_gradients:
                losses.append(float(loss.detach()))
                step += 1
                if step == args.save_at:
                    folder = os.path.join(args.out, f"step-{step}")
                    accelerator.save_state(folder)
                    commopt.save_checkpoint(os.path.join(folder, "commopt"), model, opt, step=step)

    if args.diloco:  # the last sync of any steps since the previous one, buffers averaged
        opt.finish(model.buffers())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    identical, world = True, 1
    if dist.is_initialized():
        world = dist.get_world_size()
        everyone = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(everyone, flat)
        identical = all(torch.equal(everyone[0], t) for t in everyone)
    if accelerator.is_main_process:
        os.makedirs(args.out, exist_ok=True)
        stats = {k: v for k, v in opt.comm_stats().items() if not isinstance(v, dict)}
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "replicas_identical": identical,
                    "world_size": world,
                    "comm_stats": stats,
                    "lockstep_warned": any("ran in lockstep" in str(w.message) for w in warned),
                    "parameters_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
                },
                f,
                indent=1,
            )
    # The framework created the process group, so it is ours to end, and through commopt: the
    # prepared DDP model still holds the group, and torch's call alone can deadlock gloo when
    # that model is freed (docs/ddp.md, "Ending the run").
    if dist.is_initialized():
        commopt.destroy_process_group()


if __name__ == "__main__":
    main()
