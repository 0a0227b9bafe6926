"""Re-sharding across view changes (``ShardedOptimizer.replan``), with the
ranks of each view simulated in this process (no processes: the fast lane;
tests/test_sharded.py runs a real gloo group): through a kill, a join and a
second kill, every rank's parameters stay bit-identical to the replicated
optimizer's after every step, every partition keeps 2 copies, only the
copies the plan moves are fetched, and a kill of both owners of a partition
is refused before anything changes."""

from __future__ import annotations

import pytest
import torch

from rollcall.membership.shards import ShardPlan, moves, place
from rollcall.worker.sharded import PartitionState, ShardedOptimizer, ShardLost

COUNT, COPIES = 12, 2

# The user's optimizer is never stepped (its state is sharded): the
# scheduler warns, and its learning rate reaches the shards all the same,
# which the equality with the replicated run checks.
pytestmark = pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler\.step\(\)`")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 11), torch.nn.Tanh(), torch.nn.Linear(11, 3))


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    decayed = [p for n, p in model.named_parameters() if n.endswith("weight")]
    plain = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW([{"params": decayed}, {"params": plain, "weight_decay": 0.0}],
                             lr=1e-2, weight_decay=0.1)  # fmt: skip


class Job:
    """The ranks of one job, and the replicated run they must match."""

    def __init__(self, members: list[str]) -> None:
        self.reference = _model()
        self.replicated = _optimizer(self.reference)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.replicated, step_size=2, gamma=0.5)
        self.plan = place(members, {}, COUNT, COPIES)
        self.ranks: dict[str, tuple[torch.nn.Module, ShardedOptimizer, object]] = {}
        for member in members:
            self._add(member, self.plan)
        self.steps = 0

    def _add(self, member: str, plan: ShardPlan) -> ShardedOptimizer:
        model = _model()
        model.load_state_dict(self.reference.state_dict())  # a joiner gets the parameters
        optimizer = _optimizer(model)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        for _ in range(getattr(self, "steps", 0)):
            scheduler.step()  # a joiner's scheduler is restored to the job's
        sharded = ShardedOptimizer(optimizer, plan, member)
        self.ranks[member] = (model, sharded, scheduler)
        return sharded

    def step(self, compare: bool = False) -> dict[str, tuple[int, ...]]:
        """One step on every rank; returns what each rank's ``receive``
        found differing (``compare``)."""
        generator = torch.Generator().manual_seed(self.steps)
        x, y = torch.randn(16, 9, generator=generator), torch.randn(16, 3, generator=generator)
        self.reference.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(self.reference(x), y).backward()
        members = list(self.ranks)
        for model, sharded, _ in self.ranks.values():
            for p, q in zip(model.parameters(), self.reference.parameters(), strict=True):
                p.grad = None if q.grad is None else q.grad.clone()  # the reduced gradient
            sharded.update()
        payloads = [sharded.payload(members) for _, sharded, _ in self.ranks.values()]
        differing = {}
        for member, (_, sharded, scheduler) in self.ranks.items():
            differing[member] = sharded.receive(payloads, members, compare=compare)
            scheduler.step()
        self.replicated.step()
        self.scheduler.step()
        self.steps += 1
        for member, (model, _, _) in self.ranks.items():
            pairs = zip(model.parameters(), self.reference.parameters(), strict=True)
            assert all(torch.equal(p, q) for p, q in pairs), (member, self.steps)
        return differing

    def change(self, dead: list[str], joiners: list[str]) -> tuple[int, int]:
        """A view change: the dead are gone, the joiners arrive; returns
        (copies fetched, copies the plan moves)."""
        survivors = [m for m in self.ranks if m not in dead]
        members = survivors + joiners
        plan = place(members, {}, COUNT, COPIES, previous=self.plan)
        old = self.plan

        def fetch(p: int) -> PartitionState:
            source = next(m for m in old.owners[p] if m in survivors)
            return self.ranks[source][1].export(p)

        for member in dead:
            del self.ranks[member]
        fetched = 0
        for member in joiners:
            fetched += len(self._add(member, old).replan(plan, survivors, fetch))
        for member in survivors:
            fetched += len(self.ranks[member][1].replan(plan, survivors, fetch))
        self.plan = plan
        for owners in plan.owners:
            assert len(owners) == COPIES
        return fetched, len(moves(old, plan))


def test_kills_and_joins_keep_the_sharded_run_equal_to_the_replicated_one() -> None:
    job = Job(["w0", "w1", "w2", "w3"])
    for _ in range(3):
        job.step()
    assert job.change(["w2"], []) == (6, 6)  # the copies w2 held: 12 x 2 / 4
    for _ in range(3):
        job.step()
    fetched, moved = job.change([], ["w4"])
    assert fetched == moved and moved >= COUNT * COPIES // 4
    for _ in range(3):
        job.step()
    fetched, moved = job.change(["w0"], [])
    assert fetched == moved
    for _ in range(3):
        job.step()
    held = {m: len(s.owned) for m, (_, s, _) in job.ranks.items()}
    assert sum(held.values()) == COUNT * COPIES


def test_a_kill_of_every_owner_of_a_partition_is_refused_and_changes_nothing() -> None:
    job = Job(["w0", "w1", "w2", "w3"])
    job.step()
    pair = job.plan.owners[0]
    _, sharded, _ = job.ranks[next(m for m in job.ranks if m not in pair)]
    owned, held = sharded.owned, sharded.state_bytes()
    survivors = [m for m in job.ranks if m not in pair]
    plan = place(survivors, {}, COUNT, COPIES, previous=job.plan)
    with pytest.raises(ShardLost, match="newest durable checkpoint"):
        sharded.replan(plan, survivors, lambda p: pytest.fail("fetched"))
    assert (sharded.owned, sharded.state_bytes()) == (owned, held)
    job.step()  # the old view trains on untouched


def test_the_gathered_state_is_the_replicated_optimizers_and_loads_into_any_plan() -> None:
    job = Job(["w0", "w1", "w2"])
    for _ in range(3):
        job.step()
    parts = [job.ranks[job.plan.owners[p][0]][1].export(p) for p in range(COUNT)]
    _, sharded, _ = job.ranks["w0"]
    whole = sharded.gathered_state(parts)
    want = job.replicated.state_dict()
    assert whole["state"].keys() == want["state"].keys()
    for index, entries in want["state"].items():
        assert whole["state"][index].keys() == entries.keys()
        assert all(torch.equal(whole["state"][index][k], v) for k, v in entries.items())
    assert whole["param_groups"] == want["param_groups"]
    with pytest.raises(ValueError, match="missing"):
        sharded.gathered_state(parts[1:])
    # A checkpoint of it loads at another world size: two ranks, other plan.
    plan = place(["x", "y"], {}, COUNT, COPIES)
    fresh = ShardedOptimizer(_optimizer(job.reference), plan, "x")
    fresh.load_state(whole)
    again = fresh.gathered_state([fresh.export(p) for p in range(COUNT)])
    for index, entries in want["state"].items():
        assert all(torch.equal(again["state"][index][k], v) for k, v in entries.items())


def test_a_move_keeps_the_copies_it_gives_up_until_the_next_update() -> None:
    job = Job(["w0", "w1", "w2", "w3"])
    job.step()
    old = job.plan
    plan = place(["w0", "w1", "w2", "w3", "w4"], {}, COUNT, COPIES, previous=old)
    giver = next(m for m in job.ranks if set(old.owned_by(m)) - set(plan.owned_by(m)))
    _, sharded, _ = job.ranks[giver]
    given = sorted(set(old.owned_by(giver)) - set(plan.owned_by(giver)))
    before = {p: sharded.export(p) for p in given}
    assert sharded.move_to(plan, {}, keep=True) == ()
    assert sorted(sharded.owned) == sorted(plan.owned_by(giver))
    for p in given:  # still served, unchanged, while the view may yet be given up
        assert sharded.holds(p) and sharded.needs(plan) == ()
        kept = sharded.export(p)
        pairs = zip(kept.segments, before[p].segments, strict=True)
        assert all(torch.equal(a[k], b[k]) for a, b in pairs for k in a)
    sharded.update()
    assert not any(sharded.holds(p) for p in given)
    with pytest.raises(ValueError, match="does not own"):
        sharded.export(given[0])


def test_a_received_partition_of_the_wrong_shape_is_refused_and_changes_nothing() -> None:
    job = Job(["w0", "w1"])
    job.step()
    _, sharded, _ = job.ranks["w0"]
    plan = place(["w0", "w1", "w2"], {}, COUNT, COPIES, previous=job.plan)
    newcomer = job._add("w2", job.plan)
    newcomer.forget()
    [first, *_] = newcomer.needs(plan)
    good = sharded.export(first)
    bad = PartitionState(first, tuple({k: v[:1] if v.dim() else v for k, v in s.items()}
                                      for s in good.segments))  # fmt: skip
    received = {p: sharded.export(p) for p in newcomer.needs(plan)}
    with pytest.raises(ValueError, match="shape"):
        newcomer.move_to(plan, {**received, first: bad})
    assert newcomer.owned == ()
    with pytest.raises(ValueError, match="not received"):
        newcomer.move_to(plan, {})
    assert sorted(newcomer.move_to(plan, received)) == sorted(received)


def test_owners_that_compute_alike_never_find_their_copies_differing() -> None:
    """Each owner of a partition compares its copy with the one its sender
    sent, bit for bit: through steps, a kill and a join, nothing differs."""
    job = Job(["a", "b", "c", "d"])
    found = [job.step(compare=True) for _ in range(2)]
    job.change(dead=["b"], joiners=["e"])
    found += [job.step(compare=True) for _ in range(2)]
    assert all(differing == () for step in found for differing in step.values()), found


def test_copies_that_are_nan_alike_are_not_found_differing() -> None:
    """NaN is not equal to itself, but two owners that computed the same NaN
    hold the same bits: not a drift."""
    job = Job(["a", "b", "c"])
    for _, sharded, _ in job.ranks.values():
        for p in sharded.owned:
            for copy in sharded.copy_of(p):
                copy.data.fill_(float("nan"))
    payloads = [sharded.payload(list(job.ranks)) for _, sharded, _ in job.ranks.values()]
    found = {
        m: s.receive(payloads, list(job.ranks), compare=True) for m, (_, s, _) in job.ranks.items()
    }
    assert found == {"a": (), "b": (), "c": ()}


@pytest.mark.parametrize("nudged_sends_it", [True, False], ids=["sender nudged", "spare nudged"])
def test_a_copy_one_ulp_apart_is_found_by_the_owner_that_did_not_send_it(
    nudged_sends_it: bool,
) -> None:
    """One owner's copy of partition p drifts by one unit in the last place:
    the owner of p that did not send it finds p differing, the sender and
    every other rank find nothing; the model follows the sender's copy."""
    job = Job(["a", "b", "c"])
    job.step()
    members = list(job.ranks)
    nudged = "a"
    sharded = job.ranks[nudged][1]
    sent = set(sharded.sent_by_me(members))
    p = next(p for p in sharded.owned if (p in sent) == nudged_sends_it)
    other = next(m for m in job.plan.owners[p] if m != nudged)
    assert sharded.sender_of(p, members) == (nudged if nudged_sends_it else other)
    first = sharded.copy_of(p)[0].view(-1)[:1]
    with torch.no_grad():
        first.copy_(torch.nextafter(first, first + 1))
    payloads = [s.payload(members) for _, s, _ in job.ranks.values()]
    found = {m: s.receive(payloads, members, compare=True) for m, (_, s, _) in job.ranks.items()}
    finder = other if nudged_sends_it else nudged
    assert found[finder] == (p,), found
    assert all(differing == () for m, differing in found.items() if m != finder), found


def test_a_change_to_the_models_parameters_after_the_all_gather_is_found_by_their_sender() -> None:
    """``changed``: each rank finds the partitions it sends whose parameters
    in the model are no longer its copy; an untouched model shows none."""
    job = Job(["a", "b", "c"])
    job.step()
    members = list(job.ranks)
    assert all(sharded.changed(members) == () for _, sharded, _ in job.ranks.values())
    model, sharded, _ = job.ranks["b"]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(0.5)
    assert sharded.changed(members) == sharded.sent_by_me(members) != ()
    assert job.ranks["a"][1].changed(members) == ()


def test_a_single_element_changed_names_only_its_partition() -> None:
    job = Job(["a", "b", "c"])
    job.step()
    members = list(job.ranks)
    model, sharded, _ = job.ranks["b"]
    # The flat state space: the optimizer's groups in order (weights, then biases).
    named = list(model.named_parameters())
    ordered = [p for n, p in named if n.endswith("weight")] + [
        p for n, p in named if n.endswith("bias")
    ]
    p = sharded.sent_by_me(members)[-1]
    segment = [s for s in sharded.segments if s.partition == p][-1]
    index = (segment.start + segment.stop) // 2
    for parameter in ordered:
        if index < parameter.numel():
            with torch.no_grad():
                parameter.view(-1)[index] += 1.0
            break
        index -= parameter.numel()
    assert sharded.changed(members) == (p,)
