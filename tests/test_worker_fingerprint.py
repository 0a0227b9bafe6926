"""The worker's side of the fingerprint: the same script and seed give the
same fingerprint in every process, and each kind of difference between two
workers shows up in the field that names it."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from rollcall.membership.fingerprint import (
    MAX_VALUE_LENGTH,
    JobFingerprint,
    compare,
    describe_mismatch,
)
from rollcall.worker.examples.lm import LMConfig, build
from rollcall.worker.fingerprint import (
    DATA_OFF,
    VARYING,
    bounded,
    code_digests,
    data_probe,
    job_fingerprint,
    user_settings,
)
from rollcall.worker.loader import MicrobatchLoader
from rollcall.worker.plan import DataPlan
from tests.harness import ROOT
from tests.loader_worker import Counter

SMALL = LMConfig(d_model=16, layers=1, corpus_bytes=20_000)

#: Computes the example's fingerprint in a fresh interpreter and prints it.
FINGERPRINT_SCRIPT = """
import json, sys
from rollcall.worker.examples.lm import LMConfig, build
from rollcall.worker.fingerprint import job_fingerprint
from rollcall.worker.plan import DataPlan
model, optimizer, corpus = build(LMConfig(d_model=16, layers=1, corpus_bytes=20_000), 3)
plan = DataPlan(len(corpus), 32, 8, 3)
print(json.dumps(job_fingerprint(model, optimizer, plan).as_dict()))
"""


def example(
    seed: int = 3,
    global_batch: int = 32,
    micro_batch: int = 8,
    config: LMConfig = SMALL,
    **options: Any,
) -> JobFingerprint:
    model, optimizer, corpus = build(config, seed)
    plan = DataPlan(len(corpus), global_batch, micro_batch, seed)
    return job_fingerprint(model, optimizer, plan, **options)


def differing(joiner: JobFingerprint, job: JobFingerprint) -> list[str]:
    return [d.name for d in compare(joiner, job)]


def in_a_new_process(hash_seed: str) -> dict[str, str]:
    result = subprocess.run(
        [sys.executable, "-c", FINGERPRINT_SCRIPT],
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": hash_seed},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return dict(json.loads(result.stdout))


@pytest.mark.integration
def test_the_same_script_and_seed_give_the_same_fingerprint_in_every_process() -> None:
    # Different hash seeds: nothing may depend on hash() or on set order.
    first, second = in_a_new_process("1"), in_a_new_process("2")
    assert first == second
    assert first == example().as_dict()


def test_every_computed_field_is_filled() -> None:
    values = example().as_dict()
    assert values["global_batch"] == "32"
    assert values["micro_batch"] == "8"
    assert values["seed"] == "3"
    assert values["optimizer"] == "torch.optim.adamw.AdamW"
    assert "lr=0.003" in values["optimizer_settings"]
    assert "weight_decay=0.01" in values["optimizer_settings"]
    assert "params" not in values["optimizer_settings"]
    assert values["scheduler"] == values["scheduler_settings"] == values["grad_scaler"] == "none"
    assert values["extras"] == "[]"
    assert values["initial_state"].startswith("sha256:")
    assert values["torch"] == torch.__version__
    parameters = sum(t.numel() for t in build(SMALL, 3)[0].state_dict().values())
    assert values["model"].startswith(f"{len(build(SMALL, 3)[0].state_dict())} tensors, ")
    assert f"{parameters:,} elements, sha256:" in values["model"]
    assert all(len(v) <= MAX_VALUE_LENGTH for v in values.values())


def test_another_model_seed_changes_only_the_initial_state() -> None:
    model, optimizer, corpus = build(SMALL, 4)
    other = job_fingerprint(model, optimizer, DataPlan(len(corpus), 32, 8, 3))
    assert differing(other, example()) == ["initial_state"]


def test_another_seed_for_everything_changes_the_seed_and_the_initial_state() -> None:
    assert differing(example(seed=4), example()) == ["seed", "initial_state"]


def test_another_global_batch_is_named() -> None:
    assert differing(example(global_batch=64), example()) == ["global_batch"]


def test_another_micro_batch_is_named() -> None:
    assert differing(example(micro_batch=4), example()) == ["micro_batch"]


def test_another_data_set_length_is_named() -> None:
    config = LMConfig(d_model=16, layers=1, corpus_bytes=30_000)
    assert differing(example(config=config), example()) == ["num_samples"]


def test_another_model_shape_is_named() -> None:
    config = LMConfig(d_model=32, layers=1, corpus_bytes=20_000)
    assert differing(example(config=config), example()) == ["model", "modules", "initial_state"]


def _net(activation: nn.Module, dropout: float = 0.1, eps: float = 1e-5) -> JobFingerprint:
    torch.manual_seed(0)
    layers = (nn.Linear(4, 8), activation, nn.Dropout(dropout), nn.LayerNorm(8, eps=eps))
    model = nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return job_fingerprint(model, optimizer, DataPlan(64, 8, 4, 0))


def test_module_settings_the_parameters_do_not_show_are_named_in_the_modules_field() -> None:
    """Another dropout rate, norm eps or activation leaves every parameter
    alike: before, nothing compared them, and such a worker's gradients
    were averaged with the others'."""
    base = _net(nn.ReLU())
    assert str(base.get("modules")).startswith("5 modules, sha256:")
    assert _net(nn.ReLU()) == base
    assert differing(_net(nn.GELU()), base) == ["modules"]
    assert differing(_net(nn.GELU(approximate="tanh")), _net(nn.GELU())) == ["modules"]
    assert differing(_net(nn.ReLU(), dropout=0.2), base) == ["modules"]
    assert differing(_net(nn.ReLU(), eps=1e-6), base) == ["modules"]


def test_torch_modules_count_by_their_attributes_even_where_extra_repr_is_silent() -> None:
    def layer(**options: Any) -> JobFingerprint:
        torch.manual_seed(0)
        model = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, **options)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return job_fingerprint(model, optimizer, DataPlan(64, 8, 4, 0))

    assert nn.TransformerEncoderLayer(16, 2).extra_repr() == ""
    assert differing(layer(activation="gelu"), layer()) == ["modules"]
    assert differing(layer(norm_first=True), layer()) == ["modules"]


class _Logged(nn.Module):
    """A user module whose attribute holds something of the process."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.log_name = f"run-{os.getpid()}-{id(self)}"


def test_a_user_modules_own_attributes_are_not_compared_only_its_extra_repr() -> None:
    torch.manual_seed(0)
    first, second = _Logged(), _Logged()
    second.load_state_dict(first.state_dict())
    assert first.log_name != second.log_name
    plan = DataPlan(64, 8, 4, 0)

    def of(model: nn.Module) -> JobFingerprint:
        return job_fingerprint(model, torch.optim.SGD(model.parameters(), lr=0.1), plan)

    assert of(first) == of(second)


def test_a_frozen_parameter_changes_the_model_field() -> None:
    model, optimizer, corpus = build(SMALL, 3)
    next(model.parameters()).requires_grad_(False)
    frozen = job_fingerprint(model, optimizer, DataPlan(len(corpus), 32, 8, 3))
    assert differing(frozen, example()) == ["model"]


def test_a_buffer_counts_in_the_model_field() -> None:
    with_buffer = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    torch.manual_seed(0)
    without = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    plan = DataPlan(10, 2, 1, 0)

    def fingerprint(model: nn.Module) -> JobFingerprint:
        return job_fingerprint(model, torch.optim.SGD(model.parameters(), lr=0.1), plan)

    assert "model" in differing(fingerprint(with_buffer), fingerprint(without))
    assert fingerprint(with_buffer).as_dict()["model"].startswith("7 tensors, ")


def test_another_optimizer_class_is_named() -> None:
    model, _, corpus = build(SMALL, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.003)
    other = job_fingerprint(model, sgd, DataPlan(len(corpus), 32, 8, 3))
    names = differing(other, example())
    assert names == ["optimizer", "optimizer_settings"]
    assert other.get("optimizer") == "torch.optim.sgd.SGD"


def test_another_learning_rate_is_named_with_both_values() -> None:
    config = LMConfig(d_model=16, layers=1, corpus_bytes=20_000, lr=1e-3)
    joiner, job = example(config=config), example()
    assert differing(joiner, job) == ["optimizer_settings"]
    message = describe_mismatch("run1", compare(joiner, job))
    assert "this worker's optimizer_settings has lr=0.001 but job run1's has lr=0.003" in message


def test_parameter_groups_show_their_differing_settings_per_group() -> None:
    model, _, corpus = build(SMALL, 3)
    weights = [p for p in model.parameters() if p.dim() > 1]
    others = [p for p in model.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": weights}, {"params": others, "weight_decay": 0.0}], lr=0.003
    )
    settings = job_fingerprint(model, optimizer, DataPlan(len(corpus), 32, 8, 3)).as_dict()[
        "optimizer_settings"
    ]
    words = settings.split(" ")
    assert words[0] == "groups=2"
    assert "lr=0.003" in words
    assert "g0.weight_decay=0.01" in words and "g1.weight_decay=0.0" in words


def test_a_scheduler_and_its_settings_are_named() -> None:
    def with_scheduler(step_size: int | None) -> JobFingerprint:
        model, optimizer, corpus = build(SMALL, 3)
        scheduler = (
            None if step_size is None else torch.optim.lr_scheduler.StepLR(optimizer, step_size)
        )
        plan = DataPlan(len(corpus), 32, 8, 3)
        return job_fingerprint(model, optimizer, plan, scheduler=scheduler)

    none, every_10, every_20 = with_scheduler(None), with_scheduler(10), with_scheduler(20)
    # A scheduler adds "initial_lr" to the parameter groups, too.
    assert differing(every_10, none) == ["optimizer_settings", "scheduler", "scheduler_settings"]
    assert every_10.get("scheduler") == "torch.optim.lr_scheduler.StepLR"
    assert differing(every_20, every_10) == ["scheduler_settings"]
    message = describe_mismatch("run1", compare(every_20, every_10))
    assert "has step_size=20 but job run1's has step_size=10" in message


def test_a_grad_scaler_is_named() -> None:
    scaler = torch.amp.GradScaler("cpu")
    scaled = example(grad_scaler=scaler)
    assert differing(scaled, example()) == ["grad_scaler"]
    assert scaled.get("grad_scaler") == "torch.amp.grad_scaler.GradScaler"


def test_registered_extras_are_named_sorted() -> None:
    extras = example(extras={"step_counter": 0, "ema": {}})
    assert extras.get("extras") == '["ema","step_counter"]'
    assert differing(extras, example()) == ["extras"]
    assert example(extras={"ema": {}, "step_counter": 1}) == extras


def _clip(step: Any) -> None:
    """A before_update hook."""


class _Clip:
    """A before_update hook that is an object."""

    def __call__(self, step: Any) -> None:
        """Clips nothing: only its name is compared."""


def test_the_before_update_hook_is_named_by_its_module_and_name() -> None:
    """A worker whose loop has another hook between the reduced gradient and
    the update (clipping, or none) applies other updates: the replicas part
    (before, only the drift check noticed, every 100 steps)."""
    hooked = example(before_update=_clip)
    assert example().get("before_update") == "none"
    assert hooked.get("before_update") == f"{__name__}._clip"
    assert example(before_update=_Clip()).get("before_update") == f"{__name__}._Clip"
    assert differing(hooked, example()) == ["before_update"]
    assert example(before_update=lambda step: None).get("before_update") == (
        f"{__name__}.test_the_before_update_hook_is_named_by_its_module_and_name.<locals>.<lambda>"
    )
    assert example(before_update=_clip) == hooked


class _Text(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample ``i``: ``(bytes i..i+3 of text, i)``; ``noise`` adds bytes drawn
    from the OS (no seed reaches them); ``host`` adds a path string."""

    def __init__(self, text: bytes, noise: bool = False, host: str = "") -> None:
        self.text, self.noise, self.host = text, noise, host

    def __len__(self) -> int:
        return len(self.text) - 3

    def __getitem__(self, i: int) -> Any:
        chunk = torch.frombuffer(bytearray(self.text[i : i + 3]), dtype=torch.uint8)
        if self.noise:
            chunk = chunk + torch.frombuffer(bytearray(os.urandom(3)), dtype=torch.uint8)
        if self.host:
            return chunk, torch.tensor(i), f"/mnt/{self.host}/text"
        return chunk, torch.tensor(i)


def read(dataset: Any, seed: int = 3) -> str:
    """The ``data`` field of a worker reading ``dataset`` (no loader process)."""
    plan = DataPlan(len(dataset), 32, 8, seed)
    loader = MicrobatchLoader(dataset, plan, collate=lambda samples: list(samples))
    with loader:
        return data_probe(loader.probe())


TEXT = bytes(range(256)) * 4


def test_workers_reading_the_same_samples_agree_on_the_data_field() -> None:
    value = read(_Text(TEXT))
    assert value.startswith("sha256:") and value == read(_Text(bytes(TEXT)))
    assert example().get("data") == DATA_OFF  # computed only from a loader's reads


def test_another_data_set_of_the_same_length_is_named_in_the_data_field() -> None:
    """Same length and seed, other samples (another preprocessing, another
    Python's stdlib for the example's corpus): before, nothing compared them."""
    other = bytes((b + 1) % 256 for b in TEXT)
    assert len(_Text(other)) == len(_Text(TEXT))
    assert read(_Text(other)) != read(_Text(TEXT))
    assert read(_Text(TEXT), seed=4) != read(_Text(TEXT))  # another first microbatch


def test_samples_that_hold_something_of_the_host_differ_in_the_data_field() -> None:
    assert read(_Text(TEXT, host="a")) != read(_Text(TEXT, host="b"))
    assert read(_Text(TEXT, host="a")) == read(_Text(TEXT, host="a"))


def test_reads_that_differ_are_said_alike_on_every_worker() -> None:
    assert read(_Text(TEXT, noise=True)) == VARYING == read(_Text(bytes(TEXT), noise=True))
    assert data_probe([torch.zeros(2), torch.ones(2)]) == VARYING


@dataclasses.dataclass
class _Record:
    tokens: Any
    note: Any


def test_values_other_than_tensors_are_read_by_content_or_by_class() -> None:
    """numpy arrays and scalars, bytes and dataclasses by content; any other
    object by its class alone (never its repr, which holds an address)."""

    def sample(array: Any, blob: bytes) -> Any:
        return [{"array": array, "scalar": numpy.float32(0.5), "blob": blob,
                 "record": _Record(torch.arange(3), object()), object(): object()}]  # fmt: skip

    one = data_probe([sample(numpy.arange(4), b"ab"), sample(numpy.arange(4), b"ab")])
    assert one.startswith("sha256:")
    assert data_probe([sample(numpy.arange(4), b"ab")] * 2) == one
    assert data_probe([sample(numpy.arange(1, 5), b"ab")] * 2) != one
    assert data_probe([sample(numpy.arange(4), b"ac")] * 2) != one
    strings = numpy.array(["a", "b"])
    assert data_probe([strings, numpy.array(["c"])]).startswith("sha256:")  # by class


def test_runtime_flags_are_fields_of_their_own() -> None:
    flagged = example(flags={"min_workers": "2", "exact": "true"})
    assert flagged.get("min_workers") == "2" and flagged.get("exact") == "true"
    assert differing(flagged, example()) == ["min_workers", "exact"]


@pytest.mark.parametrize("name", ["min_wokers", "seed"])
def test_a_flag_must_be_a_declared_field_the_worker_does_not_compute(name: str) -> None:
    with pytest.raises(ValueError, match="is not a fingerprint flag"):
        example(flags={name: "1"})


def test_a_long_value_is_shortened_and_two_long_values_still_differ() -> None:
    long_a, long_b = "x" * 400 + "a", "x" * 400 + "b"
    assert len(bounded(long_a)) == MAX_VALUE_LENGTH
    assert bounded(long_a) != bounded(long_b)
    assert bounded("short") == "short"


def test_a_value_outside_printable_ascii_is_escaped() -> None:
    escaped = example(extras={"\u00e9t\u00e9\n": 0}).get("extras")
    assert escaped is not None and escaped.isascii() and "\n" not in escaped


# --- the code a worker runs ---------------------------------------------------------

#: A user's model module and training script; the script prints its code field.
USER_MODEL = """
import torch


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.linear(x))
"""
USER_LOSS = """
def loss(out, target):
    return ((out - target) ** 2).mean()
"""
USER_SCRIPT = """
import functools
import pathlib
import torch
import userloss
import usermodel
from rollcall.worker.fingerprint import code_digests


def clip(step, norm):
    return norm  # a stand-in hook: only the module that defines it counts


model = torch.nn.Sequential(usermodel.Block(), torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
objects = [*model.modules(), optimizer, functools.partial(clip, norm=1.0)]
print(code_digests(objects, __name__, pathlib.Path(__file__).resolve().parent))
"""


def code_of(directory: Any, hash_seed: str = "0") -> str:
    path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, str(directory / "train.py")], cwd=directory,
        env={**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": path},
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return result.stdout.strip()


def user_code(
    directory: Any, model: str = USER_MODEL, script: str = USER_SCRIPT, loss: str = USER_LOSS
) -> Any:
    directory.mkdir()
    (directory / "usermodel.py").write_text(model)
    (directory / "userloss.py").write_text(loss)
    (directory / "train.py").write_text(script)
    return directory


@pytest.mark.integration
def test_code_names_each_user_module_with_the_digest_of_its_source(tmp_path: Any) -> None:
    # Two hosts with the same files (other directories, other hash seeds).
    here = code_of(user_code(tmp_path / "a"), "1")
    there = code_of(user_code(tmp_path / "b"), "2")
    assert here == there
    # The script, the module defining a model's class, and a module the
    # script imported from its directory (its loss); not torch's.
    assert re.fullmatch(r"__main__=\w{8} userloss=\w{8} usermodel=\w{8}", here), here
    # The digest is the file's bytes' (a comment counts: another version).
    main = hashlib.sha256(USER_SCRIPT.encode()).hexdigest()[:8]
    assert here.startswith(f"__main__={main} ")
    # Another version of the model's module, or of the loss: its digest
    # alone differs, and the mismatch names it.
    model = USER_MODEL.replace("torch.relu(", "torch.tanh(")
    loss = USER_LOSS.replace("mean()", "sum()")
    versions = [(2, user_code(tmp_path / "c", model=model)),
                (1, user_code(tmp_path / "d", loss=loss))]  # fmt: skip
    for index, directory in versions:
        other = code_of(directory)
        pairs = zip(other.split(), here.split(), strict=True)
        differ = [i for i, (a, b) in enumerate(pairs) if a != b]
        assert differ == [index], (other, here)
        ours = JobFingerprint.of({**example().as_dict(), "code": other})
        job = JobFingerprint.of({**example().as_dict(), "code": here})
        said = describe_mismatch("run1", compare(ours, job))
        mine, theirs = other.split()[index], here.split()[index]
        assert f"this worker's code has {mine} but job run1's has {theirs}" in said


SRC_SCRIPT = """
import pathlib
import torch
from pkg.losses import loss
from pkg.model import Block
from rollcall.worker.fingerprint import code_digests

model = torch.nn.Sequential(Block(), torch.nn.Linear(4, 1))
print(code_digests(list(model.modules()), __name__, pathlib.Path(__file__).resolve().parent))
"""


def src_layout_code(root: Any, script_dir: Any, loss: str = USER_LOSS) -> str:
    """``code`` of a script in ``script_dir`` using package ``pkg`` of a
    ``src/`` layout project at ``root`` (on the path, as an editable
    install puts it)."""
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "pyproject.toml").write_text("[project]\nname = 'pkg'\n")
    (root / "src" / "pkg" / "__init__.py").write_text("")
    (root / "src" / "pkg" / "model.py").write_text(USER_MODEL)
    (root / "src" / "pkg" / "losses.py").write_text(loss)
    script_dir.mkdir(parents=True, exist_ok=True)
    (script_dir / "train.py").write_text(SRC_SCRIPT)
    path = os.pathsep.join(p for p in (str(root / "src"), os.environ.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, str(script_dir / "train.py")], cwd=script_dir,
        env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=120,
        check=True,
    )  # fmt: skip
    return result.stdout.strip()


@pytest.mark.integration
@pytest.mark.parametrize("where", ["scripts", "outside"])
def test_code_takes_the_modules_of_the_project_the_script_or_its_model_comes_from(
    tmp_path: Any, where: str
) -> None:
    # A src/ layout: the script in the project's scripts/ directory, or in a
    # directory of no project; the model and the loss in the project's package.
    def script_dir(root: Any) -> Any:
        return root / "scripts" if where == "scripts" else root.parent / f"run-{root.name}"

    here = src_layout_code(tmp_path / "a", script_dir(tmp_path / "a"))
    assert re.fullmatch(r"__main__=\w{8} pkg=\w{8} pkg.losses=\w{8} pkg.model=\w{8}", here), here
    # Another version of the loss, which no job object's class names.
    other = src_layout_code(
        tmp_path / "b", script_dir(tmp_path / "b"), loss=USER_LOSS.replace("mean()", "sum()")
    )
    differ = [a for a, b in zip(other.split(), here.split(), strict=True) if a != b]
    assert [word.split("=")[0] for word in differ] == ["pkg.losses"], (other, here)


def test_code_leaves_out_the_interpreters_own_files_inside_a_project(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A virtual environment kept in the project: a console script in its
    # bin is __main__ (its first line names the environment's path, which
    # differs between hosts); a module of the project counts.
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "helper.py").write_text("")
    scripts = Path(sysconfig.get_paths()["scripts"])
    for name, file in (("console_entry", scripts / "train"), ("helper", tmp_path / "helper.py")):
        module = types.ModuleType(name)
        module.__file__ = str(file)
        monkeypatch.setitem(sys.modules, name, module)
    assert code_digests([], None, tmp_path) == "helper=" + hashlib.sha256(b"").hexdigest()[:8]
    assert "console_entry" not in code_digests([], None, scripts.parent)


class _UserBase(nn.Module):
    """A user's base class, defined in this module as the class below."""


class _UserNet(_UserBase):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def hook(self, step: Any) -> None:
        """A stand-in bound-method hook: only the module that defines it counts."""


def test_code_takes_functions_methods_partials_and_bases_and_leaves_out_torch_and_python() -> None:
    net = _UserNet()
    this = __name__
    assert code_digests([net.linear, torch.optim.SGD(net.parameters(), lr=0.1)], None) == "none"
    assert code_digests([dataclasses.replace], "json") == "none"  # Python's own

    def names(code: str) -> list[str]:
        return [word.split("=")[0] for word in code.split()]

    # (With the modules imported from the project they come from: this
    # repository's, here.)
    for obj in (net, net.hook, functools.partial(net.hook), _user_function):
        assert this in names(code_digests([obj], None)), obj
    # A class's bases count where they are defined.
    derived = names(code_digests([_Derived()], None))
    assert {"tests.loader_worker", this} <= set(derived)
    assert not {n for n in derived if n.partition(".")[0] in ("torch", "rollcall", "json")}
    # An empty file is source too (tests/__init__.py).
    empty = "tests=" + hashlib.sha256(b"").hexdigest()[:8]
    assert code_digests([], "tests").split()[0] == empty
    # Every process whose module has no source says so alike.
    assert code_digests([], "no_such_module_anywhere") == "no_such_module_anywhere=nosource"


def _user_function() -> None:
    """A stand-in user function: only the module that defines it counts."""


class _Derived(Counter):
    """A class of this module whose base is defined in tests.loader_worker."""


def test_the_scripts_own_settings_read_alike_from_a_dict_or_a_namespace() -> None:
    given = {"smoothing": 0.1, "amp": True, "loss": "focal loss", "layers": [2, 4], "tag": None}
    value = user_settings(given)
    assert value == (
        'amp=true layers=[2,4] loss="focal\\u0020loss" smoothing=0.1 tag=null'
    )
    assert user_settings(argparse.Namespace(**given)) == value
    assert user_settings({}) == "none"
    field = {"settings": value}
    other = {"settings": user_settings({**given, "smoothing": 0.0})}
    message = describe_mismatch(
        "run1", compare(JobFingerprint.of(other), JobFingerprint.of(field))
    )
    # The words that differ, alone.
    assert "this worker's settings has smoothing=0.0 but job run1's has smoothing=0.1:" in message


@pytest.mark.parametrize(
    ("settings", "error", "says"),
    [
        ({"out": object()}, TypeError, "settings['out'] is a object"),
        ({"path": os}, TypeError, "settings['path'] is a module"),
        ({"a b": 1}, ValueError, "names are words"),
        ({"a=b": 1}, ValueError, "names are words"),
        ([("lr", 1)], TypeError, "settings= is a list"),
    ],
)
def test_a_setting_that_cannot_be_compared_is_refused_naming_it(
    settings: Any, error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=re.escape(says)):
        user_settings(settings)


def test_long_settings_are_cut_with_a_digest_of_the_whole() -> None:
    many = {f"setting_{i}": i for i in range(40)}
    value = bounded(user_settings(many))
    assert len(value) <= MAX_VALUE_LENGTH
    assert value != bounded(user_settings({**many, "setting_39": -1}))
