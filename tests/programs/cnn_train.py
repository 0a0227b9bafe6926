"""An ordinary training script, ported to rollcall as docs/porting.md shows.

A small CNN with BatchNorm and dropout learns a synthetic ten-class image
set (a map-style Dataset with random flips), read through a DataLoader with
worker processes; AdamW with a OneCycleLR schedule; gradient clipping;
evaluation every few steps on rank 0 while the others wait; the final model
saved. Run under ``rollcall up -- python tests/programs/cnn_train.py`` or
with ``ROLLCALL_RENDEZVOUS``/``ROLLCALL_JOB``/``ROLLCALL_TOKEN`` set.

For the tests it prints one JSON line per event on stdout, and
``--reference`` runs the same training in one process without rollcall
(the single-process run the elastic one is compared with). Flags named
``--misuse-...`` make the mistakes a port must be refused for.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset

from rollcall import Config, Elastic, ViewChanged
from rollcall.worker.digest import tree_digest


class Shapes(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Ten classes of 12x12 images: a class pattern plus noise, flipped at
    random (augmentation drawn from the global torch RNG, or with
    ``own_rng`` from a numpy generator the data set holds)."""

    def __init__(self, size: int, seed: int, own_rng: bool = False) -> None:
        import numpy

        self.rng = numpy.random.default_rng(seed) if own_rng else None
        #: How often a sample is flipped: what a curriculum kept in the data
        #: set would change (``--harder-data-at``).
        self.flip_chance = 0.5
        generator = torch.Generator().manual_seed(seed)
        patterns = torch.randn(10, 1, 12, 12, generator=generator)
        self.labels = torch.randint(0, 10, (size,), generator=generator)
        self.images = patterns[self.labels] + 0.8 * torch.randn(
            size, 1, 12, 12, generator=generator
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if (torch.rand(()) if self.rng is None else self.rng.random()) < self.flip_chance:
            image = image.flip(-1)
        return image, self.labels[index]


class Centre(nn.Module):
    """Centres the features by a running mean, assigned anew in each
    training forward pass (``self.mean = ...``, as custom layers often
    write it) rather than changed in place."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        return x - self.mean


class Net(nn.Module):
    def __init__(
        self,
        width: int = 8,
        aux: bool = False,
        reused: bool = False,
        centred: bool = False,
        model_generator: str = "none",
    ) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.MaxPool2d(2),
        )  # fmt: skip
        self.dropout = nn.Dropout(0.2)
        self.head = nn.Linear(2 * width * 6 * 6, 10)
        #: A second head trained only in the first steps (``--aux-until``):
        #: a parameter that the later steps' forward passes never reach.
        self.aux = nn.Linear(12 * 12, 10) if aux else None
        #: A layer run twice on the logits, each run under reentrant
        #: checkpointing (``--reentrant-reuse``), as a model library's
        #: gradient checkpointing of a block shared between layers does:
        #: its gradient is accumulated once per run in one backward pass.
        self.mix = nn.Linear(10, 10) if reused else None
        self.mix_runs = 2
        self.centre = Centre(2 * width * 6 * 6) if centred else None
        #: A dropout of the model's own, drawing its masks from a generator
        #: the model holds (``--model-generator``): made here, assigned after
        #: Elastic(...) by the script, or made by the first forward pass.
        self.noise = torch.Generator().manual_seed(7) if model_generator == "build" else None
        self.noise_made_in_forward = model_generator == "in-forward"

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.features(images).flatten(1)
        if self.centre is not None:
            features = self.centre(features)
        if self.noise is None and self.noise_made_in_forward:
            self.noise = torch.Generator().manual_seed(7)
        if self.noise is not None and self.training:
            keep = torch.rand(features.shape, generator=self.noise) > 0.2
            features = features * keep / 0.8
        logits = self.head(self.dropout(features))
        if self.mix is not None:
            for _ in range(self.mix_runs):
                logits = logits + checkpoint(self.mix, logits, use_reentrant=True)
        return logits


class EMA:
    """An exponential moving average of the weights: user state that must
    travel with the replica (registered with Elastic(state=...))."""

    def __init__(self, model: nn.Module, decay: float = 0.9, forgetful: bool = False) -> None:
        self.decay = decay
        self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        #: ``load_state_dict`` keeps its own weights (``--ema-load-forgets``):
        #: a port whose state class forgot a field.
        self.forgetful = forgetful

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for name, value in model.state_dict().items():
            if value.is_floating_point():
                self.weights[name].mul_(self.decay).add_(value, alpha=1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay = state["decay"]
        if not self.forgetful:
            self.weights = {k: v.clone() for k, v in state["weights"].items()}


def loss_sum(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.0,
    aux: bool = False,
) -> tuple[Any, int]:
    loss = F.cross_entropy(model(images), labels, reduction="sum", label_smoothing=smoothing)
    if aux:
        loss = loss + F.cross_entropy(model.aux(images.flatten(1)), labels, reduction="sum")
    return loss, len(labels)


@torch.no_grad()
def evaluate(model: nn.Module, data: Shapes) -> float:
    model.eval()
    loss = F.cross_entropy(model(data.images), data.labels).item()
    model.train()
    return loss


def aux_weights(model: Net) -> list[float]:
    """The second head's weights, summed per output: what its updates did."""
    assert model.aux is not None
    return model.aux.weight.detach().double().sum(dim=1).tolist()


def say(**record: Any) -> None:
    print(json.dumps(record), flush=True)


def build(args: argparse.Namespace) -> tuple[Net, torch.optim.Optimizer, Any, Shapes, Shapes]:
    torch.manual_seed(args.model_seed)
    model = Net(
        aux=args.aux_until >= 0, reused=args.reentrant_reuse, centred=args.centred,
        model_generator=args.model_generator,
    )  # fmt: skip
    # With --second-optimizer the head is left to an optimizer of its own.
    params = [p for name, p in model.named_parameters()
              if not (args.second_optimizer and name.startswith("head."))]  # fmt: skip
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.steps * args.phases
    )
    train = Shapes(args.samples, seed=1, own_rng=args.own_generators)
    return model, optimizer, scheduler, train, Shapes(256, seed=2)


class Clip:
    """Gradient clipping by global norm, run by the runtime between the
    reduced, normalised gradient and the optimizer step."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        nan_at: int,
        lr_nan_at: int,
        noise: float = 0.0,
        zero_grad: str | None = None,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.norm = 0.0
        self.nan_at, self.lr_nan_at = nan_at, lr_nan_at
        self.noise = noise
        self.zero_grad = zero_grad

    def __call__(self, step: Any) -> None:
        self.norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        if self.noise:  # gradient noise drawn from torch's global generator (as in DP-SGD)
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.add_(torch.randn_like(param.grad), alpha=self.noise)
        if step.number == self.nan_at:  # a gradient divided by a norm of 0
            head = self.model.head.bias.grad
            assert head is not None
            head.div_(torch.zeros_like(head))
        if step.number == self.lr_nan_at:  # a schedule computed to NaN: the update is NaN
            for group in self.optimizer.param_groups:
                group["lr"] = float("nan")
        if self.zero_grad == "head":  # a part frozen by dropping its gradients
            for param in self.model.head.parameters():
                param.grad = None
        elif self.zero_grad == "all":  # a plain loop's zero_grad() after its clipping
            self.optimizer.zero_grad()


@torch.no_grad()
def evaluate_shard(job: Elastic, model: nn.Module, data: Shapes) -> float | None:
    """Every rank evaluates its share of the validation set; the summed loss
    is all-reduced (None if the view changed meanwhile)."""
    rank, size = job.rank or 0, job.world_size or 1
    model.eval()
    images, labels = data.images[rank::size], data.labels[rank::size]
    totals = torch.tensor(
        [F.cross_entropy(model(images), labels, reduction="sum").item(), len(labels)],
        dtype=torch.float64,
    )
    model.train()
    try:
        job.all_reduce(totals)
    except ViewChanged:
        return None
    return float(totals[0] / totals[1])


def requeue(signum: int, _frame: Any) -> None:
    """A script's own SIGTERM handler (``--own-sigterm``), as a cluster
    script's that saves and requeues."""
    say(event="requeue", signal=signum)


def train(args: argparse.Namespace) -> None:
    if args.own_sigterm:
        signal.signal(signal.SIGTERM, requeue)
    model, optimizer, scheduler, data, validation = build(args)
    loader = DataLoader(data, batch_size=args.micro_batch, num_workers=args.loader_workers)
    ema = EMA(model, forgetful=args.ema_load_forgets)
    clip = Clip(
        model, optimizer, args.hook_nan_at, args.lr_nan_at, args.grad_noise,
        args.zero_grad_in_hook,
    )
    scaler = None
    if args.grad_scaler or args.disabled_grad_scaler:  # as mixed precision off builds it
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=args.grad_scaler)
    # A second optimizer, for the head, that the loop steps itself (as a
    # port of a job with two optimizers, Muon and AdamW say, would).
    head_optimizer = None
    if args.second_optimizer:
        head_optimizer = torch.optim.SGD(model.head.parameters(), lr=args.lr)
    settings: dict[str, Any] = {}
    if args.collective_timeout is not None:
        settings["collective_timeout"] = args.collective_timeout
    if args.bucket_bytes is not None:
        settings["overlap_bucket_bytes"] = args.bucket_bytes
    config = Config(**settings) if settings else None
    with Elastic(
        model, optimizer, loader if args.loader_workers else data,
        global_batch=args.global_batch, micro_batch=args.micro_batch, seed=args.seed,
        scheduler=scheduler, grad_scaler=scaler, state={"ema": ema},
        before_update=None if args.no_clip else clip,
        min_workers=args.min_workers, ledger=args.ledger, config=config, exact=args.exact,
        overlap=args.overlap,
        shard_redundancy=args.shard_redundancy, shard_partitions=args.shard_partitions,
        checkpoint_every=args.checkpoint_every, max_skipped_steps=args.max_skipped_steps,
        # The script's own setting every worker must share; its paths differ.
        settings={"label_smoothing": args.label_smoothing},
    ) as job:  # fmt: skip
        say(event="joined", member_id=job.member_id)
        if args.model_generator == "after-elastic":
            model.noise = torch.Generator().manual_seed(7)
        own = iter(DataLoader(data, batch_size=args.micro_batch, shuffle=True))

        def own_batches() -> Any:  # a port that kept its own DataLoader
            for _ in range(args.global_batch // args.micro_batch):
                images, labels = next(own)
                yield argparse.Namespace(inputs=images, targets=labels)

        if args.late_warmup:  # built after Elastic, beside the registered one
            warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5)
        def steps() -> Any:
            for _ in range(args.epoch_loop):  # a port that kept its epoch loop around steps()
                yield from job.steps(args.steps)
            for phase in range(1, args.phases):  # then more steps, a phase at a time
                yield from job.steps(args.steps * (phase + 1))

        for step in steps():
            while args.hold_while and os.path.exists(args.hold_while):
                time.sleep(0.05)  # a test holds the team until a joiner is in
            model.mix_runs = 1 if step.number < args.reuse_once_until else 2
            if step.number == args.harder_data_at:  # a curriculum kept in the data set
                data.flip_chance = 0.9
            if args.zero_grad_at_step_start:  # a plain loop's first line, before the step's
                optimizer.zero_grad()
            batches = own_batches() if args.own_loader else step.microbatches()
            if args.commit_only:  # a loop whose training happens elsewhere
                batches = iter(())
            for position, batch in enumerate(batches):
                if position == args.break_after:  # a loop that leaves the step early
                    break
                if args.ported_zero_grad:  # a plain loop's first line, kept inside the step
                    optimizer.zero_grad(set_to_none=args.ported_zero_grad == "none")
                if step.number == args.nan_input_at and step.rank == 0:
                    batch.inputs[0, 0, 0, 0] = float("nan")  # one pixel of a bad sample
                inputs = batch.inputs
                if args.own_generators:  # a shift drawn in the loop from numpy and random
                    import random

                    import numpy

                    inputs = inputs + 0.1 * numpy.random.rand() - 0.1 * random.random()
                loss, count = loss_sum(model, inputs, batch.targets, args.label_smoothing,
                                       aux=step.number < args.aux_until)  # fmt: skip
                nan = args.nan_at <= step.number < args.nan_at + args.nan_for
                if args.nan_at >= 0 and nan and step.rank == 0:
                    loss = loss * float("nan")  # a step that diverges, on one rank
                if args.ported_loss == "mean":  # a port that kept the default reduction
                    loss = F.cross_entropy(model(batch.inputs), batch.targets)
                elif args.ported_loss == "accumulated":  # kept an accumulation's division too
                    loss = F.cross_entropy(model(batch.inputs), batch.targets) / 4
                elif args.ported_loss == "divided":  # summed, then divided: the mean again
                    loss = loss / count
                elif args.ported_loss == "scaled" and scaler is not None:  # kept AMP's scale()
                    loss = scaler.scale(loss)
                step.backward(loss, count)
                if args.all_reduce_in_step:  # a global count of the microbatch's samples
                    job.all_reduce(torch.tensor([float(count)]))
                if args.misuse_scheduler:
                    scheduler.step()
                if args.late_warmup:
                    warmup.step()
                if step.number < args.slow_until:
                    time.sleep(args.microbatch_pause)  # a kill lands mid-step
            if args.step_penalty:  # an L2 penalty added once per step, after the microbatches
                penalty = sum(p.square().sum() for p in model.parameters())
                step.backward(args.step_penalty * penalty, 0)
            if args.second_optimizer == "before" and head_optimizer is not None:
                head_optimizer.step()
            if step.number == args.skip_commit_at:  # a loop that skips a step it finds bad
                args.skip_commit_at = -1
                continue
            if not step.commit():
                say(event="aborted", step=step.number, epoch=step.epoch)
                continue
            if args.second_optimizer == "after" and head_optimizer is not None:
                head_optimizer.step()
                head_optimizer.zero_grad()
            time.sleep(args.after_commit_pause)  # a roll call or a checkpoint lands here
            ema.update(model)
            record = {"event": "step", "step": step.number, "loss": step.loss,
                      "epoch": step.epoch, "rank": step.rank, "world": step.world_size,
                      "lr": optimizer.param_groups[0]["lr"], "grad_norm": clip.norm}  # fmt: skip
            if model.aux is not None:
                record["aux"] = aux_weights(model)
            if args.digests:
                record["digest"] = job.state_digest()
                record["model"] = tree_digest(model.state_dict())
            if job.resharded is not None and job.resharded["epoch"] == step.epoch:
                record["resharded"] = job.resharded
            if job.resumed is not None:
                record["resumed"] = {"s_ckpt": job.resumed.s_ckpt, "s_done": job.resumed.s_done,
                                     "seconds": job.resumed.seconds}  # fmt: skip
            say(**record)
            if step.rank == 0 and args.eval_every and (step.number + 1) % args.eval_every == 0:
                with job.busy("evaluation"):
                    started = time.monotonic()
                    value = evaluate(model, validation)
                    time.sleep(args.eval_pause)
                say(event="eval", step=step.number, loss=value,
                    seconds=time.monotonic() - started)  # fmt: skip
            if args.eval_all and (step.number + 1) % args.eval_all == 0:
                shared = evaluate_shard(job, model, validation)
                say(event="eval_all", step=step.number, loss=shared, world=job.world_size,
                    alone=evaluate(model, validation))  # fmt: skip
        say(event="done", step=job.committed_step)
        if job.rank == 0 and args.save:
            torch.save(model.state_dict(), args.save)
        if args.save_all:
            torch.save(model.state_dict(), f"{args.save_all}/model-{job.member_id}.pt")
        if args.save_state:
            whole = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict()}  # fmt: skip
            torch.save(whole, f"{args.save_state}/state-{job.member_id}.pt")


def reference(args: argparse.Namespace) -> None:
    """The same training in one process, no rollcall: every microbatch of a
    step in index order, loaded and seeded as the runtime does (the samples'
    augmentation from the load seed, the forward pass from the microbatch
    seed)."""
    from torch.utils.data import default_collate

    from rollcall.worker.loader import load_microbatch
    from rollcall.worker.plan import DataPlan, load_seed

    model, optimizer, scheduler, data, _ = build(args)
    ema = EMA(model, forgetful=args.ema_load_forgets)
    plan = DataPlan(len(data), args.global_batch, args.micro_batch, args.seed)
    for number in range(args.until or args.steps):
        total, count = 0.0, 0
        for mb in plan.microbatches(number):
            images, labels = load_microbatch(
                data, default_collate, mb.sample_ids, load_seed(args.seed, number, mb.index)
            )
            torch.manual_seed(mb.seed)
            loss, n = loss_sum(model, images, labels, args.label_smoothing,
                               aux=number < args.aux_until)  # fmt: skip
            loss.backward()
            total += float(loss.detach())
            count += n
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(count)
        norm = 0.0
        if not args.no_clip:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(model)
        say(event="step", step=number, loss=total / count, lr=optimizer.param_groups[0]["lr"],
            grad_norm=norm, model=tree_digest(model.state_dict()),
            **({"aux": aux_weights(model)} if model.aux is not None else {}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=48)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="data plan seed")
    parser.add_argument("--model-seed", type=int, default=0, help="initial weights")
    parser.add_argument("--loader-workers", type=int, default=2)
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--eval-every", type=int, default=0, help="rank 0 evaluates every N steps")
    parser.add_argument(
        "--eval-all", type=int, default=0,
        help="every N steps all ranks evaluate a shard and all-reduce it",
    )  # fmt: skip
    parser.add_argument("--grad-scaler", action="store_true", help="a (CPU) GradScaler")
    parser.add_argument(
        "--disabled-grad-scaler", action="store_true", help="a GradScaler(enabled=False)"
    )
    parser.add_argument(
        "--eval-pause",
        type=float,
        default=0.0,
        help="seconds an evaluation takes on top of its compute",
    )
    parser.add_argument(
        "--collective-timeout", type=float, help="Config.collective_timeout (default: its default)"
    )
    parser.add_argument("--exact", action="store_true", help="Elastic(exact=True)")
    parser.add_argument("--overlap", action="store_true", help="Elastic(overlap=True)")
    parser.add_argument("--shard-redundancy", type=int, help="Elastic(shard_redundancy=...)")
    parser.add_argument("--shard-partitions", type=int, default=64)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument(
        "--after-commit-pause", type=float, default=0.0,
        help="seconds between commit() and the EMA update (registered state changed late)",
    )  # fmt: skip
    parser.add_argument(
        "--nan-at", type=int, default=-1, help="rank 0's loss is NaN at this step"
    )
    parser.add_argument(
        "--lr-nan-at", type=int, default=-1, help="the clipping hook sets a NaN lr at this step"
    )
    parser.add_argument(
        "--nan-input-at", type=int, default=-1, help="a NaN pixel in rank 0's data at this step"
    )
    parser.add_argument("--nan-for", type=int, default=1, help="... and the next N-1")
    parser.add_argument("--max-skipped-steps", type=int, default=100)
    parser.add_argument(
        "--ported-loss", choices=["mean", "accumulated", "divided", "scaled"],
        help="give step.backward a loss a port got wrong: averaged (and divided by a "
        "gradient accumulation's count), summed and divided by its count, or already scaled",
    )  # fmt: skip
    parser.add_argument(
        "--second-optimizer", choices=["before", "after", "never"],
        help="leave the head (trainable) to a second optimizer (SGD) that the loop steps "
        "before or after commit(), or never",
    )  # fmt: skip
    parser.add_argument(
        "--zero-grad-at-step-start", action="store_true",
        help="call optimizer.zero_grad() at the top of each step, before its microbatches",
    )
    parser.add_argument(
        "--ported-zero-grad", choices=["none", "zeros"],
        help="call optimizer.zero_grad() before each microbatch, as a plain loop does before "
        "each batch: set_to_none=True (none) or False (zeros)",
    )  # fmt: skip
    parser.add_argument(
        "--zero-grad-in-hook", choices=["all", "head"],
        help="the clipping hook then calls optimizer.zero_grad() (all), or sets the head's "
        "gradients to None (head)",
    )  # fmt: skip
    parser.add_argument(
        "--aux-until", type=int, default=-1,
        help="add a second head, trained by the loss of the steps before this one only",
    )  # fmt: skip
    parser.add_argument(
        "--hook-nan-at", type=int, default=-1,
        help="the clipping hook leaves a NaN gradient at this step",
    )  # fmt: skip
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument("--hold-while", help="before each step, wait while this file exists")
    parser.add_argument(
        "--microbatch-pause", type=float, default=0.0,
        help="seconds after each microbatch's backward, in steps before --slow-until",
    )  # fmt: skip
    parser.add_argument("--slow-until", type=int, default=0, help="see --microbatch-pause")
    parser.add_argument(
        "--save-state", help="every rank saves model, optimizer and scheduler state here"
    )
    parser.add_argument("--ledger")
    parser.add_argument("--save", help="rank 0 saves the final model here")
    parser.add_argument("--save-all", help="every rank saves its final model in this directory")
    parser.add_argument("--digests", action="store_true", help="print each step's state digest")
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--until", type=int, help="with --reference: stop after this many steps")
    parser.add_argument(
        "--late-warmup", action="store_true",
        help="build a second LR scheduler after Elastic and step it in the loop",
    )  # fmt: skip
    parser.add_argument(
        "--grad-noise", type=float, default=0.0,
        help="before_update adds this much noise from torch's global generator to the gradient",
    )  # fmt: skip
    parser.add_argument(
        "--own-generators", action="store_true",
        help="flips drawn from a numpy generator the data set holds and a shift of the "
        "inputs the loop draws from numpy's and random's global generators",
    )  # fmt: skip
    parser.add_argument(
        "--ema-load-forgets", action="store_true",
        help="the EMA's load_state_dict keeps its own weights (a port's forgotten field)",
    )  # fmt: skip
    parser.add_argument(
        "--harder-data-at", type=int, default=-1,
        help="the loop sets the data set's flip_chance to 0.9 at this step (a curriculum)",
    )  # fmt: skip
    parser.add_argument(
        "--model-generator", choices=("none", "build", "after-elastic", "in-forward"),
        default="none",
        help="a dropout drawing from a torch.Generator the model holds, made with the model, "
        "assigned after Elastic(...), or made by the first forward pass",
    )  # fmt: skip
    parser.add_argument(
        "--centred", action="store_true",
        help="centre the features by a running mean buffer the forward pass assigns anew",
    )  # fmt: skip
    parser.add_argument(
        "--reentrant-reuse", action="store_true",
        help="run a layer twice on the logits, each run under reentrant checkpointing",
    )  # fmt: skip
    parser.add_argument("--bucket-bytes", type=int, help="Config(overlap_bucket_bytes=...)")
    parser.add_argument("--no-clip", action="store_true", help="no before_update hook")
    parser.add_argument(
        "--epoch-loop", type=int, default=1,
        help="call job.steps(--steps) this many times in a row, as an epoch loop around it",
    )  # fmt: skip
    parser.add_argument(
        "--phases", type=int, default=1,
        help="go on after --steps with job.steps(--steps * k) for k = 2 .. PHASES",
    )  # fmt: skip
    parser.add_argument(
        "--skip-commit-at", type=int, default=-1,
        help="go on to the next step without committing this one (once)",
    )  # fmt: skip
    parser.add_argument(
        "--step-penalty", type=float, default=0.0,
        help="step.backward an L2 penalty of this weight once per step, after the microbatches",
    )  # fmt: skip
    parser.add_argument(
        "--all-reduce-in-step", action="store_true",
        help="job.all_reduce a count after each microbatch's backward pass",
    )  # fmt: skip
    parser.add_argument(
        "--commit-only", action="store_true", help="commit each step without running it"
    )
    parser.add_argument(
        "--own-sigterm", action="store_true",
        help="install a SIGTERM handler of the script's before Elastic is built",
    )  # fmt: skip
    parser.add_argument(
        "--own-loader", action="store_true",
        help="train each step on microbatches of the script's own DataLoader",
    )  # fmt: skip
    parser.add_argument(
        "--break-after", type=int, default=-1,
        help="leave each step's microbatch loop after this many microbatches",
    )  # fmt: skip
    parser.add_argument(
        "--reuse-once-until", type=int, default=0,
        help="with --reentrant-reuse: the layer runs once in the steps before this one",
    )  # fmt: skip
    parser.add_argument(
        "--misuse-scheduler",
        action="store_true",
        help="also step the registered scheduler in the loop",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    (reference if args.reference else train)(args)


if __name__ == "__main__":
    sys.exit(main())
