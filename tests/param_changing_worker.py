"""A training process whose loop changes its model's parameters after
``commit()`` in one of the ways a user's loop might:
python -m tests.param_changing_worker RENDEZVOUS JOB CHANGE [--sharded].

CHANGE: ``none``; ``scale`` (multiply every parameter by 0.5 after each
commit, as a clamp or a renormalisation changes them); ``freeze`` (set
the first layer's requires_grad to False after step 2); ``unfreeze``
(built with the first layer frozen, set it trainable after step 2);
``add_group`` (add a param group of a parameter the model does not hold
after step 2); ``drop_param`` (take the optimizer's last parameter out of
its group after step 2); ``replace`` (put a new Parameter, same values,
in place of the first one, in the model and the optimizer, after step 2,
as a loop that rebuilds a layer does); ``retype`` (``model.double()``
after step 2); ``hook_scale`` (``scale`` in ``before_update``, after the
reduction, before the update); ``counter_lr`` (``before_update`` sets the
learning rate from a count of its own updates, as a warm-up written
against a loop's own iteration counter does: a joiner counts from 0);
``busy_state`` (a registered tally counted inside ``job.busy()`` after
step 2); ``after_busy`` (counted after a ``job.busy()`` block, before the
next step, after step 2); ``busy_ok`` (every step: the tally counted after
``commit()`` and before ``job.busy()``, and inside it changed and put
back, as an evaluation that swaps weights in and out does); ``clip``
(``before_update`` clips the gradient's global norm to ``--clip-norm``,
a setting each worker is started with); ``commit_twice`` (``step.commit()``
called again after step 2's commit); ``backward_after`` (``step.backward``
after step 2's commit, as a loop that computes an extra loss there does);
``microbatches_after`` (``step.microbatches()`` iterated again after step 2's
commit, as a loop that reports a loss on the step's own data does);
``forget_train`` (``model.eval()`` after each commit, as a rank that
evaluates and does not call ``model.train()`` again); ``sparse_after``
(the token embedding set to ``sparse=True`` after step 2: its gradient
becomes a sparse tensor, as ``F.embedding(..., sparse=True)`` in a
model's own code makes it).
``--sharded``: redundancy 2. The checks run every 5 steps. Token from
$ROLLCALL_TOKEN. Prints the JSON step events `rollcall worker --json` does."""

from __future__ import annotations

import argparse

import torch

from rollcall.membership.config import Config
from rollcall.worker.examples.lm import LMConfig, build, loss_sum
from rollcall.worker.runtime import Elastic, Step
from tests.loader_worker import Counter
from tests.raising_worker import train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rendezvous")
    parser.add_argument("job")
    changes = ["none", "scale", "freeze", "unfreeze", "add_group", "drop_param", "replace",
               "retype", "hook_scale", "counter_lr", "busy_state", "after_busy",
               "busy_ok", "clip", "commit_twice", "backward_after", "microbatches_after",
               "forget_train", "sparse_after"]  # fmt: skip
    parser.add_argument("change", choices=changes)
    parser.add_argument("--sharded", action="store_true")
    parser.add_argument("--clip-norm", type=float, default=1.0)
    args = parser.parse_args()
    model, optimizer, corpus = build(LMConfig(), seed=0)
    corpus_batches = torch.utils.data.DataLoader(corpus, batch_size=8)
    first = next(model.parameters())
    if args.change == "unfreeze":
        first.requires_grad_(False)

    updates = 0
    tally = Counter()
    job: list[Elastic] = []

    def change(step: Step) -> None:
        nonlocal updates
        if args.change in ("busy_state", "after_busy") and step.number == 2:
            with job[0].busy("evaluation"):
                if args.change == "busy_state":
                    tally.n += 1
            tally.n += args.change == "after_busy"
        elif args.change == "busy_ok":
            tally.n += 1
            with job[0].busy("evaluation"):
                tally.n += 10
                tally.n -= 10
        elif args.change == "counter_lr":
            for group in optimizer.param_groups:
                group["lr"] = 1e-3 * min(1.0, (updates + 1) / 1000)
            updates += 1
        elif args.change == "commit_twice" and step.number == 2:
            step.commit()
        elif args.change == "backward_after" and step.number == 2:
            batch = next(iter(corpus_batches))
            loss, count = loss_sum(model, batch[0], batch[1])
            step.backward(loss, count)
        elif args.change == "microbatches_after" and step.number == 2:
            for batch in step.microbatches():
                loss_sum(model, batch.inputs, batch.targets)
        elif args.change == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
        elif args.change == "forget_train":
            model.eval()
        elif args.change in ("scale", "hook_scale"):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.mul_(0.5)
        elif args.change in ("freeze", "unfreeze") and step.number == 2:
            first.requires_grad_(args.change == "unfreeze")
        elif args.change == "add_group" and step.number == 2:
            optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        elif args.change == "drop_param" and step.number == 2:
            optimizer.param_groups[0]["params"].pop()
        elif args.change == "replace" and step.number == 2:
            name, old = next(iter(model.named_parameters()))
            owner, _, attribute = name.rpartition(".")
            new = torch.nn.Parameter(old.detach().clone())
            setattr(model.get_submodule(owner), attribute, new)
            optimizer.param_groups[0]["params"][0] = new
        elif args.change == "retype" and step.number == 2:
            model.double()
        elif args.change == "sparse_after" and step.number == 2:
            model.token_embedding.sparse = True

    hooks = ("hook_scale", "counter_lr", "clip")
    with Elastic(
        model, optimizer, corpus, global_batch=32, micro_batch=8, rendezvous=args.rendezvous,
        job=args.job, shard_redundancy=2 if args.sharded else None,
        config=Config(drift_check_every=5),
        before_update=change if args.change in hooks else None,
        state={"tally": tally} if "busy" in args.change else None,
    ) as elastic:  # fmt: skip
        job.append(elastic)
        train(elastic, model, change if args.change not in hooks else lambda step: None)


if __name__ == "__main__":
    main()
