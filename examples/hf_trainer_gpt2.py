"""Hugging Face ``Trainer`` with ``commopt.OnebitAdam`` on a tiny GPT-2 built from a config.

Nothing is downloaded: the model is ``GPT2LMHeadModel(GPT2Config(...))`` with random weights and
the data is a synthetic next-token task (counting sequences with random starts and strides).

    torchrun --nproc_per_node 2 examples/hf_trainer_gpt2.py --max-steps 60 --out /tmp/hf-run

Under ``torchrun`` the Trainer (through accelerate) wraps the model in DistributedDataParallel,
which would all-reduce every gradient in ``backward()``. ``CommoptTrainer`` registers
``commopt.ddp.onebit_hook`` on it, paired with the optimizer: for ``freeze_step`` steps the hook
averages the gradients at full precision during backward, as DDP would; after that it folds
each rank's gradient into the optimizer's momentum and exchanges the momentum at one bit, and
``step()`` applies the frozen-variance update without communicating again. Gradient
accumulation (``--accumulation``) uses DDP's ``no_sync()``, through accelerate: only the last
backward pass of a step communicates. Rank 0 writes ``result.json`` (losses, the optimizer's
``comm_stats()``, whether the replicas ended identical).

With ``--diloco H`` the optimizer is ``commopt.DiLoCo`` around ``torch.optim.AdamW`` instead
(the learning-rate schedule on DiLoCo sets the inner AdamW's lr). Its inner steps must not
communicate, so ``CommoptTrainer`` registers torch's ``noop_hook`` on the DDP model: each rank
keeps its own gradients, and every H steps DiLoCo averages the pseudo-gradient. DiLoCo is
built after ``TrainingArguments``, which starts the process group under ``torchrun``, since
building it is collective. ``result.json`` then also says, for the step before each sync,
whether the ranks' parameters differed (they must: the gradients stayed local), and
``commopt.hf.FinishDiLoCo`` ends the run with a last sync, so it leaves one model.

Checkpoints: ``--save-steps N`` saves every N steps, ``--resume OUT/checkpoint-<step>`` resumes.
The Trainer keeps rank 0's optimizer state alone; ``commopt.hf.RankStateCheckpoint`` adds each
rank's own (``commopt.save_checkpoint``) under ``checkpoint-<step>/commopt`` and loads it when
the resumed run begins, so the resume is bit-exact (tests/multirank/test_hf_trainer.py).
"""

import argparse
import hashlib
import json
import math
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import commopt
from commopt.hf import FinishDiLoCo, RankStateCheckpoint

VOCAB, LENGTH = 64, 32


class CountingDataset(torch.utils.data.Dataset):
    """Sequences a, a+s, a+2s, … (mod VOCAB): the next token follows from the last two."""

    def __init__(self, size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (size, 1), generator=g)
        stride = torch.randint(1, 4, (size, 1), generator=g)
        self.ids = (start + stride * torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class CommoptTrainer(Trainer):
    """A Trainer whose DDP model communicates through commopt's hook (once it is wrapped)."""

    def __init__(
        self, *args, commopt_optimizer: commopt.OnebitAdam | commopt.DiLoCo, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.commopt_optimizer = commopt_optimizer  # the Trainer wraps it; the hook needs ours

    def training_step(self, model, inputs, num_items_in_batch=None):  # type: ignore[override]
        if isinstance(model, DistributedDataParallel) and not getattr(model, "_commopt", False):
            # onebit_hook, or for DiLoCo torch's noop_hook: the inner steps stay local
            commopt.ddp.register_hook(model, self.commopt_optimizer)
            model._commopt = True
        return super().training_step(model, inputs, num_items_in_batch)


class LossLog(TrainerCallback):
    def __init__(self, model: torch.nn.Module, sync_every: int = 0) -> None:
        self.losses: list[float] = []
        self.model, self.sync_every = model, sync_every
        self.differed_before_syncs: list[bool] = []

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[override]
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[override]
        if self.sync_every and (state.global_step + 1) % self.sync_every == 0:
            self.differed_before_syncs.append(not _replicas_identical(self.model))


def _replicas_identical(model: torch.nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if not dist.is_initialized():
        return True
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], t) for t in everyone)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--freeze-step", type=int, default=15)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--accumulation", type=int, default=1, help="backward passes per step")
    parser.add_argument("--diloco", type=int, default=0, help="H: commopt.DiLoCo around AdamW")
    parser.add_argument("--out", default="hf-run")
    parser.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N steps")
    parser.add_argument("--resume", help="a checkpoint-<step> folder to resume from")
    args = parser.parse_args()
    torch.set_num_threads(1)

    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=args.out,
        max_steps=args.max_steps,
        per_device_train_batch_size=16 // args.accumulation,
        gradient_accumulation_steps=args.accumulation,
        logging_steps=5,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        ddp_broadcast_buffers=False,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    # after TrainingArguments, which starts the process group under torchrun: building DiLoCo
    # is collective (OnebitAdam's first collective is in its first step)
    if args.diloco:
        inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
        opt = commopt.DiLoCo(inner, sync_every=args.diloco)
    else:
        opt = commopt.OnebitAdam(model.parameters(), lr=args.lr, freeze_step=args.freeze_step)
    warmup = max(1, args.max_steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(  # on DiLoCo: it sets the inner AdamW's lr
        opt,
        lambda t: min(1.0, (t + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * t / args.max_steps)),
    )
    log = LossLog(model, args.diloco)
    trainer = CommoptTrainer(
        model=model,
        args=training_args,
        train_dataset=CountingDataset(4096),
        optimizers=(opt, sched),
        callbacks=[log, RankStateCheckpoint(), FinishDiLoCo()],  # (a last sync: one model)
        commopt_optimizer=opt,
    )
    trainer.train(resume_from_checkpoint=args.resume)

    identical = _replicas_identical(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        stats = opt.comm_stats()
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(
                {
                    "losses": log.losses,
                    "replicas_identical": identical,
                    "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                    "comm_stats": {k: v for k, v in stats.items() if not isinstance(v, dict)},
                    "differed_before_syncs": log.differed_before_syncs,
                    "parameters_sha256": hashlib.sha256(
                        torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                        .numpy()
                        .tobytes()
                    ).hexdigest(),
                },
                f,
                indent=1,
            )
    # The framework created the process group, so it is ours to end, and through commopt: the
    # Trainer's DDP model still holds the group, and torch's call alone can deadlock gloo when
    # that model is freed (docs/ddp.md, "Ending the run").
    if dist.is_initialized():
        commopt.destroy_process_group()


if __name__ == "__main__":
    main()
