"""The state contract's guards: each silent misuse of a training loop found in
a user trial is refused with a UsageError that says what to change."""

from __future__ import annotations

import enum
import functools
import math
import re
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from rollcall.membership.errors import UsageError
from rollcall.worker.contract import (
    Agreed,
    Agreement,
    Agreements,
    DataWatch,
    GradientWatch,
    HookAgreement,
    Ownership,
    ParameterWatch,
    RegisteredWatch,
    buffers_not_finite,
    check_dense_gradients,
    check_distributed_modules,
    check_extras,
    check_loss,
    check_materialized,
    check_optimizer_params,
    check_optimizer_step,
    check_scheduler,
    check_steps_total,
    finite_buffers,
    in_eval_mode,
    learning_rates,
    loaded_checked,
    modes_tag,
    not_finite,
    not_finite_names,
    refuse_sparse_gradients,
    settings_tag,
    skips_non_finite,
)
from rollcall.worker.state import capture


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _backward(model: nn.Module) -> None:
    model(torch.ones(3, 4)).sum().backward()


def test_a_registered_scheduler_stepped_in_the_loop_is_refused() -> None:
    model, optimizer = _model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    Ownership(optimizer, scheduler)
    with pytest.raises(UsageError, match="remove scheduler.step"):
        scheduler.step()
    assert scheduler.last_epoch == 0, "the refused call must not have stepped it"


@pytest.mark.parametrize("call", ["update", "unscale_", "step"])
def test_a_registered_grad_scaler_stepped_or_updated_in_the_loop_is_refused(call: str) -> None:
    # An AMP loop's scaler.unscale_(opt) / scaler.step(opt) / scaler.update()
    # kept in the port: at c078440 update() failed with torch's "No inf
    # checks were recorded prior to update", and unscale_ reached commit.
    model, optimizer = _model_and_optimizer()
    scaler = torch.amp.GradScaler("cpu")
    ownership = Ownership(optimizer, None, model.parameters(), scaler=scaler)
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    scale = scaler.get_scale()
    args = [] if call == "update" else [optimizer]
    with pytest.raises(UsageError, match=rf"scaler.{call}\(\) was called in the training loop"):
        getattr(scaler, call)(*args)
    assert scaler.get_scale() == scale
    with ownership.applying():  # the runtime's own calls
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    ownership.release()
    assert type(scaler) is torch.amp.GradScaler
    assert set(scaler.state_dict()) == set(torch.amp.GradScaler("cpu").state_dict())


@pytest.mark.parametrize("combined", ["SequentialLR", "ChainedScheduler"])
def test_a_scheduler_combined_in_the_registered_one_stepped_in_the_loop_is_refused(
    combined: str,
) -> None:
    # The registered scheduler combines a warm-up and a decay; a loop that
    # still steps its warm-up runs it twice as fast, alike on every rank.
    model, optimizer = _model_and_optimizer()
    lr = torch.optim.lr_scheduler
    warmup = lr.LinearLR(optimizer, start_factor=0.1, total_iters=4)
    decay = lr.ExponentialLR(optimizer, gamma=0.9)
    if combined == "SequentialLR":
        scheduler = lr.SequentialLR(optimizer, [warmup, decay], milestones=[4])
    else:
        scheduler = lr.ChainedScheduler([warmup, decay], optimizer=optimizer)
    owned = Ownership(optimizer, scheduler)
    with pytest.raises(UsageError, match=f"LinearLR, part of the registered {combined}"):
        warmup.step()
    assert warmup.last_epoch == 0, "the refused call must not have stepped it"
    for _ in range(3):  # the runtime's own steps go through the combined one
        _backward(model)
        with owned.applying():
            optimizer.step()
        owned.step_scheduler()
    assert warmup.last_epoch == 3
    owned.release()
    warmup.step()  # given back as it was
    assert type(warmup) is lr.LinearLR


def test_the_runtime_steps_the_registered_scheduler_once_per_update() -> None:
    model, optimizer = _model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    owned = Ownership(optimizer, scheduler)
    _backward(model)
    with owned.applying():
        optimizer.step()
    owned.step_scheduler()
    assert scheduler.last_epoch == 1
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_optimizer_step_in_the_loop_is_refused() -> None:
    model, optimizer = _model_and_optimizer()
    Ownership(optimizer, None)
    _backward(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UsageError, match="step.commit"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_release_gives_the_objects_back() -> None:
    model, optimizer = _model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    Ownership(optimizer, scheduler).release()
    _backward(model)
    optimizer.step()
    scheduler.step()
    assert scheduler.last_epoch == 1


def test_an_optimizer_whose_step_needs_a_closure_is_refused_with_what_to_use() -> None:
    # LBFGS re-evaluates the loss itself (step(closure)): at eed8d21 it
    # was accepted, and every worker crashed at its first commit with a
    # bare TypeError from optimizer.step().
    model, optimizer = _model_and_optimizer()
    check_optimizer_step(optimizer)  # AdamW's closure is optional
    with pytest.raises(UsageError, match=r"LBFGS\.step\(\) needs a closure.*SGD, Adam"):
        check_optimizer_step(torch.optim.LBFGS(model.parameters()))


def test_a_model_with_lazy_parameters_not_yet_made_is_refused_with_what_to_do() -> None:
    # nn.LazyLinear's weight exists only after a first forward pass: at
    # 8baef07 Elastic(...) failed on it with torch's ValueError from deep
    # in the fingerprint, naming no parameter.
    model = nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(2))
    with pytest.raises(UsageError, match=r"1\.weight, 1\.bias.*forward pass.*before Elastic"):
        check_materialized(model)
    torch.manual_seed(0)
    model(torch.ones(1, 4))  # what the error asks for
    check_materialized(model)


def test_an_lr_scheduler_not_passed_to_the_runtime_is_refused() -> None:
    _, optimizer = _model_and_optimizer()
    check_scheduler(None, optimizer)  # none attached: fine
    torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    with pytest.raises(UsageError, match="not passed to Elastic"):
        check_scheduler(None, optimizer)


def test_a_second_lr_scheduler_beside_the_registered_one_is_refused() -> None:
    # A warm-up stepped by the loop beside the registered main schedule: the
    # runtime never sees it step, a joiner's starts from 0.
    _, optimizer = _model_and_optimizer()
    lr = torch.optim.lr_scheduler
    cosine = lr.CosineAnnealingLR(optimizer, T_max=10)
    check_scheduler(cosine, optimizer)  # alone: fine
    warmup = lr.LinearLR(optimizer, start_factor=0.1, total_iters=5)
    warmup.state_dict()  # its __dict__ is a dict object now, as after any state_dict()
    with pytest.raises(UsageError, match=r"another LR scheduler \(LinearLR\) is attached"):
        check_scheduler(cosine, optimizer)
    # The same two combined into one registered scheduler: fine.
    check_scheduler(lr.SequentialLR(optimizer, [warmup, cosine], milestones=[5]), optimizer)
    # A scheduler registered as state (a ReduceLROnPlateau stepped with a metric): fine.
    plateau = lr.ReduceLROnPlateau(optimizer)
    chained = lr.ChainedScheduler([cosine, warmup])
    check_scheduler(chained, optimizer, registered=[plateau])
    with pytest.raises(UsageError, match=r"\(ReduceLROnPlateau\)"):
        check_scheduler(chained, optimizer)


def test_reduce_lr_on_plateau_is_refused_with_what_to_do_instead() -> None:
    _, optimizer = _model_and_optimizer()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    with pytest.raises(UsageError, match="state="):
        check_scheduler(plateau, optimizer)


def test_a_scheduler_of_another_optimizer_is_refused() -> None:
    _, optimizer = _model_and_optimizer()
    _, other = _model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(other, step_size=1)
    with pytest.raises(UsageError, match="another optimizer"):
        check_scheduler(scheduler, optimizer)


def test_registered_state_needs_state_dict_and_load_state_dict() -> None:
    model, _ = _model_and_optimizer()
    assert check_extras({"ema": model}) == {"ema": model}
    with pytest.raises(TypeError, match="state_dict"):
        check_extras({"counter": 3})


def test_the_model_optimizer_scheduler_or_scaler_registered_again_in_state_is_refused() -> None:
    # A port that registers what it checkpoints, state={"model": model,
    # "optimizer": optimizer}: at 4f2fd08 the model's BatchNorm statistics,
    # changed by the forward passes, were blamed as "registered state
    # changed in the loop before commit()".
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)
    scaler = torch.amp.GradScaler("cpu")
    passed = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
              "grad_scaler": scaler}  # fmt: skip
    for argument, obj in passed.items():
        with pytest.raises(UsageError, match=rf"state\['x'\] is the {argument} passed"):
            check_extras({"x": obj}, **passed)
    part = next(m for m in model.modules() if m is not model and list(m.parameters()))
    with pytest.raises(UsageError, match=r"state\['part'\] holds parameters or buffers of"):
        check_extras({"part": part}, **passed)
    averaged = torch.optim.swa_utils.AveragedModel(model)  # a copy: its own tensors
    assert check_extras({"swa": averaged}, **passed) == {"swa": averaged}


def test_gradient_clipping_between_backward_and_commit_is_noticed() -> None:
    model, _ = _model_and_optimizer()
    watch = GradientWatch(list(model.parameters()))
    _backward(model)
    watch.mark()
    _backward(model)  # gradient accumulation over a second microbatch
    watch.mark()
    watch.check()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    with pytest.raises(UsageError, match="before_update"):
        watch.check()


def test_zero_grad_between_backward_and_commit_is_noticed() -> None:
    model, optimizer = _model_and_optimizer()
    watch = GradientWatch(list(model.parameters()))
    _backward(model)
    watch.mark()
    optimizer.zero_grad()
    with pytest.raises(UsageError, match="zero_grad"):
        watch.check()


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set to None", "zeroed in place"])
def test_zero_grad_between_two_backward_passes_of_a_step_is_noticed(set_to_none: bool) -> None:
    model, optimizer = _model_and_optimizer()
    watch = GradientWatch(list(model.parameters()))
    watch.before_backward()  # the step's first: no gradients yet
    _backward(model)
    watch.mark()
    watch.before_backward()  # nothing changed since: a second microbatch may run
    optimizer.zero_grad(set_to_none=set_to_none)
    with pytest.raises(UsageError, match=r"remove zero_grad\(\) from the loop"):
        watch.before_backward()


def test_gradients_before_the_first_step_backward_of_a_step_are_noticed() -> None:
    model, _ = _model_and_optimizer()
    watch = GradientWatch(list(model.parameters()))
    _backward(model)  # loss.backward() of a pass the runtime did not run
    with pytest.raises(UsageError, match="gradients exist before the step's first"):
        watch.before_backward()
    watch.mark()
    watch.forget()  # an update: the runtime drops the gradients with it
    model.zero_grad(set_to_none=True)
    watch.before_backward()


def test_gradients_without_step_backward_are_noticed() -> None:
    model, _ = _model_and_optimizer()
    watch = GradientWatch(list(model.parameters()))
    watch.check()  # no gradients at all: a rank without microbatches
    _backward(model)  # loss.backward() instead of step.backward()
    with pytest.raises(UsageError, match=r"step.backward\(loss_sum, count\)"):
        watch.check()


def test_another_optimizer_holding_parameters_of_the_model_is_refused_at_its_step() -> None:
    model, optimizer = _model_and_optimizer()
    owned = Ownership(optimizer, None, model.parameters())
    try:
        other = torch.optim.SGD(list(model.parameters())[:1], lr=0.1)
        with pytest.raises(UsageError, match=r"another optimizer \(SGD\) holds 1 of the model's"):
            other.step()
        with owned.applying():  # stepped by the registered one (a wrapper's inner optimizer)
            other.step()
        unrelated = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        unrelated.step()  # a model the runtime does not hold
    finally:
        owned.release()
    other.step()  # the guards are gone with the Elastic block


def test_a_guarded_scheduler_keeps_its_type_and_a_clean_state() -> None:
    _, optimizer = _model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    before = scheduler.state_dict()
    Ownership(optimizer, scheduler)
    assert isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR)
    assert type(scheduler).__name__ == "OneCycleLR"
    assert scheduler.state_dict().keys() == before.keys()


def test_a_scheduler_moved_behind_the_guards_back_is_noticed_before_the_update() -> None:
    model, optimizer = _model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    owned = Ownership(optimizer, scheduler)
    owned.check_schedule()
    # Stepped through the class itself, as a parent scheduler would.
    torch.optim.lr_scheduler.StepLR.step(scheduler)
    with pytest.raises(UsageError, match="moved from step 0 to 1"):
        owned.check_schedule()


def test_an_optimizer_parameter_outside_the_model_is_refused() -> None:
    """The runtime reduces the gradients of the model's parameters: one the
    optimizer updates that is not the model's (a free temperature, say)
    would be updated with each worker's own partial gradient."""
    model, optimizer = _model_and_optimizer()
    check_optimizer_params(model, optimizer)  # the model's own: fine
    temperature = nn.Parameter(torch.zeros(1))
    optimizer.add_param_group({"params": [temperature]})
    with pytest.raises(UsageError, match="parameter 0 of the optimizer's param group 1 is not"):
        check_optimizer_params(model, optimizer)


class _Bag(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.frozen = nn.Embedding(10, 4, sparse=True)  # no gradient: no matter
        self.frozen.weight.requires_grad_(False)
        self.words = nn.EmbeddingBag(10, 4, sparse=sparse)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.words(ids) + self.frozen(ids).mean(1))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_an_embedding_with_sparse_gradients_is_refused_at_construction(sparse: bool) -> None:
    # The reduction packs dense gradients: a sparse one failed at the first
    # commit with torch's "reshape is not implemented for sparse tensors"
    # (exact mode: "Could not run 'aten::aminmax' ... 'SparseCPU'").
    model = _Bag(sparse)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    if not sparse:
        check_dense_gradients(model, optimizer)
        return
    with pytest.raises(UsageError, match=r"words \(EmbeddingBag\) was built with sparse=True"):
        check_dense_gradients(model, optimizer)


def test_a_sync_batch_norm_is_refused_at_construction() -> None:
    # Without torch.distributed's default group SyncBatchNorm normalizes
    # each microbatch by its own statistics and says nothing; the port
    # asked for statistics over the workers' batches.
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    check_distributed_modules(model)
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert synced(torch.randn(8, 4)).shape == (8, 4)  # no error of torch's
    with pytest.raises(UsageError, match=r"1 \(SyncBatchNorm\) computes its batch statistics"):
        check_distributed_modules(synced)


def test_a_model_wrapped_in_distributed_data_parallel_is_refused_at_construction() -> None:
    class Wrapper(nn.parallel.DistributedDataParallel):
        def __init__(self, module: nn.Module) -> None:  # no process group needed to test
            nn.Module.__init__(self)
            self.module = module

    with pytest.raises(UsageError, match="wrapped in DistributedDataParallel"):
        check_distributed_modules(nn.Sequential(Wrapper(nn.Linear(4, 4))))


def test_sparse_adam_is_refused_at_construction() -> None:
    model = _Bag(sparse=False)
    optimizer = torch.optim.SparseAdam(list(model.words.parameters()), lr=0.1)
    with pytest.raises(UsageError, match="SparseAdam takes only sparse gradients"):
        check_dense_gradients(model, optimizer)


def test_a_sparse_gradient_at_commit_is_refused_naming_the_parameter() -> None:
    model = _Bag(sparse=False)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ids = torch.tensor([[1, 2], [3, 4]])
    model(ids).sum().backward()
    refuse_sparse_gradients(named, 0)  # dense: fine
    model.zero_grad(set_to_none=True)
    model.words.sparse = True  # set after construction, or F.embedding(..., sparse=True)
    model(ids).sum().backward()
    with pytest.raises(UsageError, match=r"step 1: the gradient of words\.weight is sparse"):
        refuse_sparse_gradients(named, 1)


def test_the_parameters_as_built_pass_and_every_later_change_is_named() -> None:
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))

    untouched = model()
    watch = ParameterWatch(untouched)
    nn.Linear(2, 2)  # another model's registrations are not this one's
    with torch.no_grad():  # values may change: the optimizer's, or in place on every worker
        untouched[0].weight.mul_(2)
    watch.check(0, full=True)
    untouched[0].weight = untouched[0].weight  # the same Parameter registered again
    watch.check(1)
    watch.release()

    def refused(change: object, said: str, seen_at_once: bool = True) -> None:
        m = model()
        watch = ParameterWatch(m)
        change(m)  # type: ignore[operator]
        try:
            if not seen_at_once:
                watch.check(6)  # only the full check, at the drift check steps, sees it
            with pytest.raises(UsageError, match=said):
                watch.check(7, full=not seen_at_once)
        finally:
            watch.release()

    refused(lambda m: m.append(nn.Linear(2, 2)), r"step 7: .*'2.weight' was added")
    refused(lambda m: setattr(m[0], "weight", nn.Parameter(m[0].weight.detach().clone())),
            r"'0.weight' was replaced by another Parameter")  # fmt: skip
    refused(lambda m: m.double(), r"'0.weight' changed from torch.float32 to torch.float64")
    refused(lambda m: m[0].bias.requires_grad_(False), r"'0.bias' was frozen")
    refused(lambda m: m[1].register_parameter("bias", None), r"'1.bias' was removed", False)
    refused(lambda m: setattr(m[1].weight, "data", torch.zeros(2, 4)),
            r"'1.weight' changed from shape \[2, 3\] to \[2, 4\]", False)  # fmt: skip


def test_a_parameter_shared_by_two_modules_is_one_parameter_to_the_watch() -> None:
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    watch = ParameterWatch(model)
    watch.check(1)
    model[2] = nn.Linear(3, 3)  # no longer shared: two more parameters
    with pytest.raises(UsageError, match="'2.weight' was added"):
        watch.check(2)
    watch.release()


def test_a_released_watch_leaves_torchs_registration_hooks_as_they_were() -> None:
    hooks = torch.nn.modules.module
    before = (len(hooks._global_parameter_registration_hooks),
              len(hooks._global_module_registration_hooks))  # fmt: skip
    ParameterWatch(nn.Linear(2, 2)).release()
    assert (len(hooks._global_parameter_registration_hooks),
            len(hooks._global_module_registration_hooks)) == before  # fmt: skip


def test_the_settings_tag_follows_every_numeric_setting_of_every_group_and_nothing_else() -> None:
    def optimizer(**changes: object) -> torch.optim.Optimizer:
        a, b = nn.Linear(2, 2), nn.Linear(2, 2)
        settings = {"lr": 0.1, "weight_decay": 0.01, **changes}
        return torch.optim.AdamW([{"params": a.parameters()}, {"params": b.parameters(),
                                  "lr": 0.05}], **settings)  # type: ignore[arg-type]  # fmt: skip

    tag = settings_tag(optimizer())
    assert tag == settings_tag(optimizer()) and 0 <= tag < 1 << 16  # not the parameters
    assert settings_tag(optimizer(lr=0.1 + 1e-12)) != tag
    assert settings_tag(optimizer(betas=(0.9, 0.99))) != tag
    second = optimizer()
    second.param_groups[1]["lr"] = 0.06
    assert settings_tag(second) != tag
    tensor_lr = optimizer(lr=torch.tensor(0.1, dtype=torch.float64))
    assert settings_tag(tensor_lr) == tag  # a 0-d tensor counts by its value
    assert learning_rates(second) == "0.1, 0.06"


@pytest.mark.parametrize("ranks", [1, 2, 1000])
def test_agreement_of_the_sums_is_exact_at_the_largest_tags(ranks: int) -> None:
    def sums(tags: list[int | None]) -> list[float]:
        terms = [Agreement.sum_terms(t) for t in tags]
        return [math.fsum(column) for column in zip(*terms, strict=True)]

    top = (1 << 16) - 1
    assert Agreement.agreed_sums(*sums([top] * ranks))
    assert Agreement.agreed_sums(*sums([top] * ranks + [None]))
    assert Agreement.agreed_sums(*sums([None] * ranks))
    if ranks > 1:
        assert not Agreement.agreed_sums(*sums([top] * (ranks - 1) + [top - 1]))
        assert not Agreement.agreed_sums(*sums([0] * (ranks - 1) + [1]))


def _hook_sums(probes: list[float | None]) -> list[float]:
    terms = [HookAgreement.sum_terms(p) for p in probes]
    return [math.fsum(column) for column in zip(*terms, strict=True)]


@pytest.mark.parametrize("ranks", [2, 3, 1000])
def test_gradient_probes_agree_within_the_spread_of_machines_and_not_beyond(ranks: int) -> None:
    """Machines of other kinds round the same computation apart by ~1e-7:
    that is agreement; a clip norm a per mille or more apart is not."""
    probe = 0.7318
    assert HookAgreement.agreed_sums(*_hook_sums([probe] * ranks))
    assert HookAgreement.agreed_sums(*_hook_sums([probe] * ranks + [None]))
    assert HookAgreement.agreed_sums(*_hook_sums([None] * ranks))
    assert HookAgreement.agreed_sums(*_hook_sums([probe] * (ranks - 1) + [probe * (1 + 1e-7)]))
    assert not HookAgreement.agreed_sums(*_hook_sums([probe] * (ranks - 1) + [probe * 1.01]))
    assert not HookAgreement.agreed_sums(*_hook_sums([probe] * (ranks - 1) + [probe / 100]))
    assert not HookAgreement.agreed_sums(*_hook_sums([0.0] * (ranks - 1) + [1e-3]))
    tiny, huge = 1e-30, 1e100
    assert HookAgreement.agreed_sums(*_hook_sums([tiny] * ranks))
    assert not HookAgreement.agreed_sums(*_hook_sums([tiny] * (ranks - 1) + [2 * tiny]))
    assert HookAgreement.agreed_sums(*_hook_sums([huge] * ranks))


def test_a_gradient_probe_that_is_not_finite_counts_as_none() -> None:
    assert HookAgreement.read(torch.tensor(float("inf"), dtype=torch.float64)) is None
    assert HookAgreement.read(torch.tensor(float("nan"), dtype=torch.float64)) is None
    assert HookAgreement.read(None) is None
    assert HookAgreement.read(torch.tensor(0.5, dtype=torch.float64)) == 0.5


def test_exact_modes_gradient_digests_agree_only_when_equal() -> None:
    def maxima(probes: list[float | None]) -> list[int]:
        terms = [HookAgreement.max_terms(p) for p in probes]
        return [max(column) for column in zip(*terms, strict=True)]

    assert HookAgreement.agreed_maxima(*maxima([0.25, 0.25, None]))
    assert HookAgreement.agreed_maxima(*maxima([None, None]))
    assert not HookAgreement.agreed_maxima(*maxima([0.25, 0.25 * (1 + 2**-52)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_the_finite_check_sees_one_bad_element_in_any_tensor_and_changes_no_bit(
    dtype: torch.dtype, bad: float
) -> None:
    finite = [torch.tensor([1.5, -0.0, 3e-38, -7.25]), torch.randn(1000, dtype=torch.float64)]
    grads = [*finite, torch.randn(300).to(dtype)]
    before = [g.clone() for g in grads]
    assert not not_finite(grads)
    for g, b in zip(grads, before, strict=True):  # the same bits, -0.0 included
        assert torch.equal(g.view(torch.uint8), b.view(torch.uint8))
    grads[2][123] = bad
    assert not_finite(grads)
    assert not not_finite(grads[:2])  # a group of another dtype does not see it
    named = {"a": grads[0], "b.weight": grads[1], "c.bias": grads[2]}
    assert not_finite_names(named) == "1 of 3 (c.bias)"


def test_only_an_enabled_grad_scaler_skips_a_step_that_is_not_finite() -> None:
    # A scaler built with enabled=False (mixed precision off) steps the
    # optimizer with whatever the gradient holds: it counts as none.
    assert skips_non_finite(torch.amp.GradScaler("cpu"))
    assert not skips_non_finite(torch.amp.GradScaler("cpu", enabled=False))
    assert not skips_non_finite(None)

    class Plain:
        """A scaler of its own, without is_enabled: taken to skip."""

    assert skips_non_finite(Plain())


def test_a_loss_averaged_over_its_samples_or_already_scaled_is_refused() -> None:
    f = torch.nn.functional
    x, y = torch.randn(8, 3, requires_grad=True), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    zeros = torch.zeros(8, 3)
    averaged = {
        "cross_entropy": f.cross_entropy(x, y), "mse_loss": f.mse_loss(x, zeros),
        "binary_cross_entropy_with_logits": f.binary_cross_entropy_with_logits(x, zeros),
        "l1_loss": f.l1_loss(x, zeros), "mean()": (x**2).sum(1).mean(),
    }  # fmt: skip
    for loss in averaged.values():
        with pytest.raises(UsageError, match="averaged over its samples .* 8 times too small"):
            check_loss(loss, 8, None)
        check_loss(loss, 1, None)  # count=1: every microbatch weighs alike, as documented
    check_loss(f.cross_entropy(x, y, reduction="sum"), 8, None)
    check_loss(f.cross_entropy(x, y) * 8, 8, None)  # the mean times its count is the sum
    reg = (x**2).mean()  # a mean over no samples: a regulariser
    hidden = {  # a mean behind additions, constant factors and casts, and no summed term
        "a gradient accumulation's division": f.cross_entropy(x, y) / 4,
        "a label smoothing": f.cross_entropy(x, y, label_smoothing=0.1),
        "a weighted sum": 0.9 * f.cross_entropy(x, y) + 0.1 * f.mse_loss(x, zeros),
        "an L2 penalty beside": f.cross_entropy(x, y) + 1e-4 * (x**2).sum(),
        "a cast": f.cross_entropy(x, y).double() - torch.tensor(0.5),
    }  # fmt: skip
    for what, loss in hidden.items():
        with pytest.raises(UsageError, match="averaged .*, weighing .*, reached through .*"):
            check_loss(loss, 8, None)
            pytest.fail(f"{what}: not refused")
        check_loss(loss, 1, None)
    divided = {  # the mean spelled out: a sum divided by the count given
        "a loss function's sum": f.cross_entropy(x, y, reduction="sum") / 8,
        "a sum()": (x**2).sum() / len(y),
        "a sum() times a constant": (x**2).sum() * (1 / 8),
        "a smoothed sum": f.cross_entropy(x, y, reduction="sum", label_smoothing=0.1) / 8,
        "a weighted sum": 0.5 * f.mse_loss(x, zeros, reduction="sum") / 8,
    }  # fmt: skip
    for what, loss in divided.items():
        with pytest.raises(UsageError, match=r"summed .* and divided by count=8, .* 8 times too"):
            check_loss(loss, 8, None)
            pytest.fail(f"{what}: not refused")
        check_loss(loss, 1, None)
    check_loss(0.5 * (x[:2] ** 2).sum(), 2, None)  # the usual half of squares, two samples
    for summed in (
        0.5 * f.mse_loss(x, zeros, reduction="sum"),  # a weight, not the count
        f.cross_entropy(x, y, reduction="sum") / 8 + (x**2).sum(),  # beside a sum: a weight
        f.cross_entropy(x, y, label_smoothing=0.1) * 8,
        f.cross_entropy(x, y, reduction="sum", label_smoothing=0.1),
        (0.9 * f.cross_entropy(x, y) + 0.1 * f.mse_loss(x, zeros)) * torch.tensor(8),
        f.cross_entropy(x, y, reduction="sum") + 0.01 * 8 * reg,  # the regulariser times count
        f.cross_entropy(x, y, reduction="sum") + 0.01 * reg,  # the same, as far as it shows
        f.cross_entropy(x, y) * 0 + (x**2).sum(),  # a term turned off
        torch.stack([f.cross_entropy(x, y)] * 8).sum(),  # a sum of means stops the walk
    ):
        check_loss(summed, 8, None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    summed = f.cross_entropy(x, y, reduction="sum")
    with pytest.raises(UsageError, match=r"grad scaler has scaled .* \(1024\) times too large"):
        check_loss(scaler.scale(summed), 8, scaler)
    check_loss(summed * 2.0, 8, scaler)  # another factor is the user's own
    check_loss(summed, 8, scaler)
    off = torch.amp.GradScaler("cpu", enabled=False)
    check_loss(off.scale(summed), 8, off)  # scale() of a disabled scaler changes nothing


def test_a_buffer_a_forward_pass_made_not_finite_is_seen_and_a_mask_of_inf_is_left_alone() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model.register_buffer("mask", torch.full((2, 2), -math.inf).triu(1))  # as a causal mask
    model.register_buffer("steps", torch.zeros((), dtype=torch.int64))  # not a float
    watched = finite_buffers(model)
    assert watched == {"1.running_mean", "1.running_var"}
    model(torch.randn(8, 3))
    assert not buffers_not_finite(model, watched)
    bad = torch.randn(8, 3)
    bad[2, 1] = math.nan  # one value of one sample
    model(bad)
    assert set(buffers_not_finite(model, watched)) == {"1.running_mean", "1.running_var"}


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "100"])
def test_a_max_skipped_steps_that_is_not_a_count_is_refused(bad: Any) -> None:
    from rollcall import Elastic

    model, optimizer = _model_and_optimizer()
    with pytest.raises(ValueError, match="max_skipped_steps must be an int >= 1"):
        Elastic(model, optimizer, list(range(8)), global_batch=4, micro_batch=2,
                rendezvous="127.0.0.1:1", job="j", messages=False,
                max_skipped_steps=bad)  # fmt: skip


def test_the_modes_tag_sees_any_module_out_of_the_others_training_mode() -> None:
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.BatchNorm1d(4))

    training, evaluating, one_off = model(), model().eval(), model()
    one_off[1].eval()  # a user's own toggle of one module
    modules = [list(m.modules()) for m in (training, evaluating, one_off)]
    tags = [modes_tag(m) for m in modules]
    assert len(set(tags)) == 3
    assert modes_tag(list(model().modules())) == tags[0]  # the same modes, the same tag
    assert in_eval_mode(dict(training.named_modules())) == "0 of 4"
    assert in_eval_mode(dict(evaluating.named_modules())) == "4 of 4 (the model, 0, 1, 2)"
    assert in_eval_mode(dict(one_off.named_modules())) == "1 of 4 (1)"


def test_agreements_judge_settings_gradients_and_modes_apart_in_both_reductions() -> None:
    def verdict(ranks: list[Agreements]) -> tuple[Agreed, Agreed]:
        sums = [math.fsum(c) for c in zip(*(r.sum_terms() for r in ranks), strict=True)]
        maxima = [max(c) for c in zip(*(r.max_terms() for r in ranks), strict=True)]
        return Agreements.agreed_sums(sums), Agreements.agreed_maxima(maxima)

    alike = Agreements(settings=7, probe=0.5, modes=3)
    assert verdict([alike, alike, alike._replace(settings=None, probe=None)]) == (
        Agreed(True, True, True), Agreed(True, True, True)
    )  # fmt: skip
    for field, value, want in (("settings", 8, Agreed(False, True, True)),
                               ("probe", 0.75, Agreed(True, False, True)),
                               ("modes", 4, Agreed(True, True, False))):  # fmt: skip
        assert verdict([alike, alike._replace(**{field: value})]) == (want, want), field


def test_the_gradient_probe_follows_what_a_hook_does_to_the_gradients() -> None:
    model = nn.Sequential(nn.Linear(300, 40), nn.ReLU(), nn.Linear(40, 3))
    params = list(model.parameters())
    assert HookAgreement.probe(params) is None  # no gradients yet
    model(torch.randn(8, 300)).sum().backward()
    grads = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    probe = HookAgreement.read(HookAgreement.probe(params))
    assert probe is not None and probe > 0
    again = HookAgreement.read(HookAgreement.probe(params))
    assert again == probe
    torch.nn.utils.clip_grad_norm_(params, 1e-3)  # clipping scales every element alike
    clipped = HookAgreement.read(HookAgreement.probe(params))
    norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
    assert clipped == pytest.approx(probe * 1e-3 / float(norm), rel=1e-4)
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad + torch.randn_like(grad)  # noise (DP-SGD): another probe
    assert HookAgreement.read(HookAgreement.probe(params)) != pytest.approx(probe, rel=1e-3)


class _Ema:
    """User state whose state_dict() hands out its live tensors."""

    def __init__(self) -> None:
        self.weights = {"a": torch.zeros(4), "b": torch.zeros(2)}
        self.decay = 0.9

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay, self.weights = state["decay"], state["weights"]


class _Copies(_Ema):
    """User state whose state_dict() hands out copies."""

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "weights": {k: v.clone() for k, v in self.weights.items()}}


def test_the_registered_watch_sees_in_place_and_value_changes_between_hold_and_changed() -> None:
    ema, copies = _Ema(), _Copies()
    scheduler = torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), step_size=2
    )
    watch = RegisteredWatch({"ema": ema, "copies": copies, "scheduler": scheduler, "none": None})
    assert watch.changed() == [], "nothing is held before hold()"
    watch.hold()
    assert watch.changed() == []
    with torch.no_grad():
        ema.weights["b"].mul_(0.5)  # an in-place update moves the version counter
    copies.decay = 0.5  # copies cannot be watched so: left to the joiner's check
    assert watch.changed() == ["ema"]
    watch.hold()
    ema.decay = 0.99
    scheduler.last_epoch += 1
    assert watch.changed() == ["ema", "scheduler"]
    watch.hold()
    ema.load_state_dict({"decay": 0.99, "weights": {"a": torch.ones(4), "b": torch.ones(2)}})
    assert watch.changed() == ["ema"], "tensors put in another's place"


def test_the_registered_watch_digests_every_object_by_content() -> None:
    ema, copies = _Ema(), _Copies()
    scaler = torch.amp.GradScaler("cpu")
    watch = RegisteredWatch({"ema": ema, "copies": copies, "scaler": scaler}, synced=("scaler",))
    before = watch.digest()
    with torch.no_grad():
        copies.weights["a"].add_(1.0)
    assert watch.digest() != before
    with torch.no_grad():
        copies.weights["a"].sub_(1.0)
    assert watch.digest() == before, "a change put back is no change"
    watch.hold()
    scaler.scale(torch.ones(1))
    scaler.update(new_scale=2.0)
    assert watch.changed() == [], "a synced object is not watched at every step"
    assert watch.digest() != before


@pytest.mark.parametrize(
    ("total", "error", "words"),
    [(2.5, TypeError, "as an int, got 2.5"), (True, TypeError, "got True"),
     ("100", TypeError, "got '100'"), (0, ValueError, "at least 1 step, got 0"),
     (-3, ValueError, "got -3")],
)  # fmt: skip
def test_a_steps_total_that_is_not_a_count_is_refused(
    total: Any, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=re.escape(words)):
        check_steps_total(total, None)


def test_a_steps_total_no_larger_than_one_that_ran_to_its_end_is_refused() -> None:
    check_steps_total(100, None)  # the first call
    check_steps_total(200, 100)  # a later phase: a larger total
    check_steps_total(np.int64(300), 200)  # any integral type
    for again in (100, 50):  # an epoch loop's second call, or a smaller total
        with pytest.raises(UsageError, match=rf"job.steps\({again}\) was called again after"):
            check_steps_total(again, 100)


class _Curriculum(torch.utils.data.Dataset[int]):
    def __init__(self) -> None:
        self.level = 1
        self.names = ["a", "b"]
        self.options = {"blur": 0.5, "nan": float("nan")}
        self.handle: object = None  # opened on first use
        self.reads = 0  # a counter loading keeps

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        self.reads += 1
        if self.handle is None:
            self.handle = object()
        return index * self.level


def test_a_data_set_setting_changed_after_construction_is_refused_naming_its_path() -> None:
    dataset = _Curriculum()
    collate = functools.partial(lambda batch, scale: batch, scale=2)
    watch = DataWatch(dataset, collate)
    dataset[0], dataset[1]  # the probe's loads, here
    watch.loaded()
    dataset[2]  # a step's: the counter and the handle change, and are not watched
    watch.check(0)
    for change, said in [
        (lambda: setattr(dataset, "level", 2), "the data set's level changed from 1 to 2"),
        (lambda: dataset.names.append("c"), None),  # an item added: nothing watched changed
        (lambda: dataset.names.__setitem__(0, "z"), "the data set's names[0] changed from 'a'"),
        (lambda: dataset.options.__setitem__("blur", 0.9),
         "the data set's options['blur'] changed from 0.5"),
        (lambda: collate.keywords.__setitem__("scale", 3),
         "the collate function's keywords['scale'] changed from 2 to 3"),
    ]:  # fmt: skip
        change()
        if said is None:
            watch.check(1)
            continue
        with pytest.raises(UsageError, match=re.escape(f"step 7: {said}")):
            watch.check(7)
        watch = DataWatch(dataset, collate)  # watched from here


class _Kept:
    """Registered state; ``forget`` names what its load_state_dict leaves."""

    def __init__(self, forget: str = "", consume: bool = False) -> None:
        self.step, self.weights = 0, torch.zeros(3)
        self.forget, self.consume = forget, consume

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        taken = state.pop if self.consume else state.__getitem__  # a load that consumes
        for key in ("step", "weights"):
            value = taken(key)
            if key != self.forget:
                setattr(self, key, value)


class _Phase(enum.IntEnum):
    WARMUP = 0
    DECAY = 1


class _Typed:
    """Registered state whose fields are of scalar subclasses: an IntEnum
    and a numpy float, restored as such."""

    def __init__(self) -> None:
        self.phase, self.scale = _Phase.WARMUP, np.float64(1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.phase, self.scale = _Phase(state["phase"]), np.float64(state["scale"])


def test_registered_state_of_scalar_subclasses_that_loads_whole_is_not_refused() -> None:
    # A captured state holds such values as their plain base types (an
    # IntEnum as an int, numpy.float64 as a float), and a load_state_dict
    # that turns them back restores them: at 5626231 this was refused as a
    # forgotten field ("at 'phase', 'scale'"), at every pull and resume.
    given = capture(0, *_model_and_optimizer(), extras={"phase": _Typed().state_dict()}).extras
    assert type(given["phase"]["phase"]) is int and type(given["phase"]["scale"]) is float
    given["phase"].update(phase=1, scale=0.5)
    state = _Typed()
    loaded_checked("phase", state, given["phase"])
    assert state.phase is _Phase.DECAY and state.scale == 0.5


def test_registered_state_whose_load_forgets_a_field_is_refused_naming_it() -> None:
    given = {"step": 7, "weights": torch.ones(3)}
    loaded_checked("ema", _Kept(), dict(given))
    loaded_checked("ema", _Kept(consume=True), dict(given))  # it emptied what it was given
    nan = {"step": 7, "weights": torch.tensor([1.0, float("nan"), 2.0])}
    loaded_checked("ema", _Kept(), dict(nan))  # NaN where NaN is the same state
    with pytest.raises(UsageError, match=r"state\['ema'\]: after load_state_dict.*at 'weights'"):
        loaded_checked("ema", _Kept(forget="weights"), dict(given))
