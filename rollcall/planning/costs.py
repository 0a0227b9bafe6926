"""The simulator's costs, read from this project's own benchmark results and
never typed in: each value carries the file and field it came from.

``costs_from_results`` takes the parsed JSON of bench/results/ (a mapping
from file name to its content) and returns ``Costs``; ``costs_to_dict`` and
``costs_from_dict`` move them to and from the small JSON file shipped in
this package (``measured_costs.json``, written by bench/simulate.py), which
is how an installed ``rollcall plan`` knows them without the repository.

Which number stands for what (the benchmarks' docstrings define each field):

- rollcall: a crash's detection, the roll call (by member count, from the
  view-change benchmark: the first member to receive the new view), the
  group rebuild, a joiner's state fetch (a line through the fetch times at
  two state sizes: fixed cost plus bytes over bandwidth), a replacement's
  start-up (process start to asking to join: its start to first full-size
  step, less the stall its join caused), the roll-call deadline, and how
  long an evicted worker takes to exit once its pause ends;
- launcher (torchrun, tuned): the relaunch of every rank (its hot-add stall:
  rendezvous, launch, load, first step), a crash's detection (its crash
  stall less the relaunch), a replacement's arrival at the rendezvous, and
  the rendezvous' last-call window (from the run's recorded settings);
- replica groups (TorchFT, tuned): the quorum's overhead beyond the
  heartbeat timeout (the crash stall's heartbeat-timeout case less the
  configured timeout; the other case, TorchFT 0.2.0's gloo timeout for a
  survivor that is not the dead replica's ring neighbour, is left out), the
  survivors' stall while a group heals, a replacement's start-up;
- every system: a sat-out pause's cost beyond its length;
- the fault mix of bench/detector_sweep.py (pause lengths, pauses per
  failure, share of silent failures), the default mix for planning.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rollcall.planning.errors import CostsUnreadable

SCHEMA = "rollcall.planning-costs/1"

PEERS = "peers.json"
RECOVERY = "recovery.json"
TRANSFER = "recovery-transfer.json"
VIEW_CHANGE = ("view_change.json", "view_change-512.json")
SWEEP = "detector-sweep.json"
#: Every result file the cost model reads.
RESULT_FILES = (PEERS, RECOVERY, TRANSFER, *VIEW_CHANGE, SWEEP)

#: bench/detector_sweep.py's --kill-mode: the share of its failures that are
#: silent (no TCP reset).
SILENT_SHARE_OF_KILL_MODE = {"alternate": 0.5, "silent": 1.0, "sigkill": 0.0}


@dataclass(frozen=True)
class Measured:
    """A number and where it came from (``file: field``, or how it was
    derived from such fields)."""

    value: float
    source: str


@dataclass(frozen=True)
class ByMembers:
    """A latency measured at a few member counts: linear between them, and
    beyond the largest along the last segment's slope (an extrapolation:
    ``extrapolated`` says when)."""

    members: tuple[int, ...]
    seconds: tuple[float, ...]
    source: str

    def __post_init__(self) -> None:
        if len(self.members) < 2 or len(self.members) != len(self.seconds):
            raise CostsUnreadable(f"{self.source}: needs at least two member counts")
        if list(self.members) != sorted(set(self.members)):
            raise CostsUnreadable(f"{self.source}: member counts must increase")

    def at(self, members: int) -> float:
        xs, ys = self.members, self.seconds
        if members <= xs[0]:
            return ys[0]
        i = next((k for k in range(1, len(xs)) if members <= xs[k]), len(xs) - 1)
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return max(ys[i - 1] + slope * (members - xs[i - 1]), 0.0)

    def extrapolated(self, members: int) -> bool:
        return members > self.members[-1]

    def flat_beyond(self) -> ByMembers:
        """The same, held at the largest measured count's value beyond it."""
        return ByMembers(self.members + (self.members[-1] + 1,),
                         self.seconds + (self.seconds[-1],),
                         f"{self.source}, held beyond {self.members[-1]} members")  # fmt: skip


@dataclass(frozen=True)
class RollcallCosts:
    crash_detect: Measured
    roll_call: ByMembers
    join_roll_call: ByMembers
    group_rebuild: Measured
    transfer_fixed: Measured
    transfer_bandwidth: Measured
    startup: Measured
    roll_call_deadline: Measured
    exit_after_eviction: Measured

    def transfer_s(self, state_bytes: int) -> float:
        return self.transfer_fixed.value + state_bytes / self.transfer_bandwidth.value


@dataclass(frozen=True)
class LauncherCosts:
    crash_detect: Measured
    relaunch: Measured
    join_arrival: Measured
    round_window: Measured


@dataclass(frozen=True)
class ReplicaGroupCosts:
    heartbeat_setting: Measured
    quorum_overhead: Measured
    heal_stall: Measured
    startup: Measured


@dataclass(frozen=True)
class MeasuredFaultMix:
    silent_share: Measured
    pauses_per_failure: Measured
    pause_median_s: Measured
    pause_sigma: Measured
    pause_max_s: Measured


@dataclass(frozen=True)
class Costs:
    rollcall: RollcallCosts
    launcher: LauncherCosts
    replica_groups: ReplicaGroupCosts
    pause_overhead: Measured
    fault_mix: MeasuredFaultMix
    #: The runs read: file -> its date (and commit, where recorded).
    runs: tuple[tuple[str, str], ...]


def with_flat_roll_call(costs: Costs) -> Costs:
    """``costs`` with rollcall's roll calls held at their largest measured
    member count's cost: what a control plane that aggregates per host
    (DESIGN.md, "Scale") would have to achieve; not measured."""
    rc = dataclasses.replace(costs.rollcall, roll_call=costs.rollcall.roll_call.flat_beyond(),
                             join_roll_call=costs.rollcall.join_roll_call.flat_beyond())
    return dataclasses.replace(costs, rollcall=rc)


# ------------------------------------------------------------ reading fields


def _field(results: Mapping[str, Any], file: str, path: str) -> Any:
    node: Any = results.get(file)
    if node is None:
        raise CostsUnreadable(f"{file} is missing (bench/README.md says which benchmark "
                              "writes it)")  # fmt: skip
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise CostsUnreadable(f"{file} has no field {path!r}")
        node = node[part]
    return node


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CostsUnreadable(f"{where} is not a number: {value!r}")
    return float(value)


def _read(results: Mapping[str, Any], file: str, path: str) -> Measured:
    return Measured(_number(_field(results, file, path), f"{file}: {path}"), f"{file}: {path}")


def _difference(a: Measured, b: Measured, floor: float = 0.0) -> Measured:
    return Measured(max(a.value - b.value, floor), f"{a.source} - {b.source.split(': ')[-1]}")


def _setting(results: Mapping[str, Any], file: str, path: str, pattern: str) -> Measured:
    """A number inside a recorded description string (the run's settings)."""
    text = _field(results, file, path)
    match = re.search(pattern, text) if isinstance(text, str) else None
    if match is None:
        raise CostsUnreadable(f"{file}: {path} does not say {pattern!r}")
    return Measured(float(match.group(1)), f"{file}: {path} ({match.group(0)!r})")


def _by_members(results: Mapping[str, Any], column: str) -> ByMembers:
    points: dict[int, float] = {}
    used = []
    for file in VIEW_CHANGE:
        if file not in results:
            continue
        rows = _field(results, file, "rows")
        if not isinstance(rows, list):
            raise CostsUnreadable(f"{file}: rows is not a list")
        for row in rows:
            if not isinstance(row, Mapping):
                raise CostsUnreadable(f"{file}: a row is not an object")
            where = f"{file}: rows[].{column}.p50_ms"
            count = int(_number(row.get("members"), f"{file}: rows[].members"))
            cell = row.get(column)
            value = _number(cell.get("p50_ms") if isinstance(cell, Mapping) else None, where)
            points.setdefault(count, value / 1000.0)
        used.append(file)
    if not used:
        raise CostsUnreadable(f"{' or '.join(VIEW_CHANGE)} is missing (bench/view_change.py)")
    members = tuple(sorted(points))
    source = f"{' + '.join(used)}: rows[].{column}.p50_ms by rows[].members"
    return ByMembers(members, tuple(points[m] for m in members), source)


def _transfer_line(results: Mapping[str, Any]) -> tuple[Measured, Measured]:
    rows = _field(results, TRANSFER, "state_transfer_alone")
    where = f"{TRANSFER}: state_transfer_alone[].bytes, .fetch_s.median"
    if not isinstance(rows, list) or len(rows) < 2:
        raise CostsUnreadable(f"{where}: needs fetches of at least two state sizes")
    xs = [_number(r.get("bytes"), where) for r in rows]
    ys = [_number(_field({"row": r}, "row", "fetch_s.median"), where) for r in rows]
    slope, intercept = statistics.linear_regression(xs, ys)
    if slope <= 0:
        raise CostsUnreadable(f"{where}: a larger state did not take longer to fetch")
    return (
        Measured(max(intercept, 0.0), f"{where} (line through them: fixed cost)"),
        Measured(1.0 / slope, f"{where} (line through them: bytes per second)"),
    )


def _sweep_settings(results: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    settings = _field(results, SWEEP, "settings")
    if not isinstance(settings, list) or not settings:
        raise CostsUnreadable(f"{SWEEP}: settings is empty")
    return [s for s in settings if isinstance(s, Mapping)]


def _pause_overhead(results: Mapping[str, Any]) -> Measured:
    where = f"{SWEEP}: settings[].pause_records[] not evicted: stall_s - seconds"
    extra = [
        _number(p.get("stall_s"), where) - _number(p.get("seconds"), where)
        for s in _sweep_settings(results)
        for p in s.get("pause_records", [])
        if isinstance(p, Mapping) and not p.get("evicted") and p.get("stall_s") is not None
    ]
    if not extra:
        raise CostsUnreadable(f"{where}: no such pause")
    return Measured(max(statistics.median(extra), 0.0), f"{where}, median")


def _exit_after_eviction(results: Mapping[str, Any]) -> Measured:
    where = (f"{SWEEP}: settings[].evictions[].exited_at - max(evicted_at, its pause's "
             "resumed), median")  # fmt: skip
    delays = []
    for s in _sweep_settings(results):
        resumed = {p.get("fault"): p.get("resumed") for p in s.get("pause_records", [])
                   if isinstance(p, Mapping)}  # fmt: skip
        for e in s.get("evictions", []):
            if not isinstance(e, Mapping) or e.get("pause") not in resumed:
                continue
            back = resumed[e["pause"]]
            start = _number(e.get("evicted_at"), where)
            if back is not None:
                start = max(start, _number(back, where))
            delays.append(_number(e.get("exited_at"), where) - start)
    if not delays:
        raise CostsUnreadable(f"{where}: no eviction of a paused worker recorded")
    return Measured(max(statistics.median(delays), 0.0), where)


def _fault_mix(results: Mapping[str, Any]) -> MeasuredFaultMix:
    mode = _field(results, SWEEP, "faults.kill_mode")
    if mode not in SILENT_SHARE_OF_KILL_MODE:
        raise CostsUnreadable(f"{SWEEP}: faults.kill_mode {mode!r} is not one of "
                              f"{sorted(SILENT_SHARE_OF_KILL_MODE)}")  # fmt: skip
    pause_every = _read(results, SWEEP, "faults.pause_every_s")
    kill_every = _read(results, SWEEP, "faults.kill_every_s")
    workers = _read(results, SWEEP, "parameters.workers")
    ratio = kill_every.value * workers.value / pause_every.value
    return MeasuredFaultMix(
        silent_share=Measured(SILENT_SHARE_OF_KILL_MODE[mode],
                              f"{SWEEP}: faults.kill_mode ({mode!r})"),  # fmt: skip
        pauses_per_failure=Measured(ratio, f"{SWEEP}: faults.kill_every_s x parameters.workers"
                                           " / faults.pause_every_s"),  # fmt: skip
        pause_median_s=_read(results, SWEEP, "faults.pause_median_s"),
        pause_sigma=_read(results, SWEEP, "faults.pause_sigma"),
        pause_max_s=_read(results, SWEEP, "faults.pause_max_s"),
    )


def _runs(results: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    out = []
    for file in RESULT_FILES:
        content = results.get(file)
        if not isinstance(content, Mapping):
            continue
        stamp = str(content.get("date", "undated"))
        versions = content.get("versions")
        if isinstance(versions, Mapping) and versions.get("rollcall_commit"):
            stamp += f", rollcall {str(versions['rollcall_commit'])[:10]}"
        out.append((file, stamp))
    return tuple(out)


def costs_from_results(results: Mapping[str, Any]) -> Costs:
    """The cost model from bench/results/'s JSON (file name -> parsed content)."""
    tr = "systems.torchrun"
    ft = "systems.torchft"
    rc = "systems.rollcall"
    fixed, bandwidth = _transfer_line(results)
    torchrun_relaunch = _read(results, PEERS, f"{tr}.hot_add_stall_s")
    torchft_heal = _read(results, PEERS, f"{ft}.hot_add_stall_s")
    heartbeat = _setting(results, PEERS, f"{ft}.description", r"heartbeat timeout ([\d.]+) s")
    return Costs(
        rollcall=RollcallCosts(
            crash_detect=_read(results, RECOVERY, "crash.detect_s.median"),
            roll_call=_by_members(results, "crash_first"),
            join_roll_call=_by_members(results, "join_first"),
            group_rebuild=_read(results, RECOVERY, "crash.group_rebuild_s.median"),
            transfer_fixed=fixed,
            transfer_bandwidth=bandwidth,
            startup=_difference(
                _read(results, PEERS, f"{rc}.spread.hot_add_join_to_first_step_s.median"),
                _read(results, PEERS, f"{rc}.hot_add_stall_s"),
            ),
            roll_call_deadline=_read(results, VIEW_CHANGE[0],
                                     "parameters.config.rollcall_deadline"),  # fmt: skip
            exit_after_eviction=_exit_after_eviction(results),
        ),
        launcher=LauncherCosts(
            crash_detect=_difference(_read(results, PEERS, f"{tr}.crash_stall_s"),
                                     torchrun_relaunch),  # fmt: skip
            relaunch=torchrun_relaunch,
            join_arrival=_difference(
                _read(results, PEERS, f"{tr}.spread.hot_add_join_to_first_step_s.median"),
                torchrun_relaunch,
            ),
            round_window=_setting(results, PEERS, f"{tr}.description",
                                  r"last_call_timeout=([\d.]+)"),  # fmt: skip
        ),
        replica_groups=ReplicaGroupCosts(
            heartbeat_setting=heartbeat,
            quorum_overhead=_difference(_read(results, PEERS, f"{ft}.spread.crash_stall_s.min"),
                                        heartbeat),  # fmt: skip
            heal_stall=torchft_heal,
            startup=_difference(
                _read(results, PEERS, f"{ft}.spread.hot_add_join_to_first_step_s.median"),
                torchft_heal,
            ),
        ),
        pause_overhead=_pause_overhead(results),
        fault_mix=_fault_mix(results),
        runs=_runs(results),
    )


# ------------------------------------------------------------ the shipped file

_T = TypeVar("_T")


def _to_plain(value: Any) -> Any:
    if isinstance(value, Measured):
        return {"value": value.value, "source": value.source}
    if isinstance(value, ByMembers):
        return {"members": list(value.members), "seconds": list(value.seconds),
                "source": value.source}  # fmt: skip
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    raise TypeError(f"cannot write {type(value).__name__}")


def costs_to_dict(costs: Costs, generated: str) -> dict[str, Any]:
    """The shipped file's content: the costs with their sources, the runs
    they come from and when it was generated."""
    out = {f.name: _to_plain(getattr(costs, f.name)) for f in dataclasses.fields(costs)
           if f.name != "runs"}  # fmt: skip
    return {"schema": SCHEMA, "generated": generated, "runs": dict(costs.runs), **out}


def _measured_from(item: Any, where: str) -> Measured:
    if not isinstance(item, Mapping):
        raise CostsUnreadable(f"{where} is not an object")
    return Measured(_number(item.get("value"), where), str(item.get("source")))


def _by_members_from(item: Any, where: str) -> ByMembers:
    if not (isinstance(item, Mapping) and isinstance(item.get("members"), list)
            and isinstance(item.get("seconds"), list)):  # fmt: skip
        raise CostsUnreadable(f"{where} needs lists members and seconds")
    return ByMembers(
        tuple(int(_number(m, where)) for m in item["members"]),
        tuple(_number(s, where) for s in item["seconds"]),
        str(item.get("source")),
    )


def _from_plain(kind: type[_T], data: Any, where: str) -> _T:
    if not isinstance(data, Mapping):
        raise CostsUnreadable(f"{where} is not an object")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(kind):  # type: ignore[arg-type]
        if f.name not in data:
            raise CostsUnreadable(f"{where}.{f.name} is missing")
        read = _by_members_from if f.type in ("ByMembers", ByMembers) else _measured_from
        values[f.name] = read(data[f.name], f"{where}.{f.name}")
    return kind(**values)


_PARTS: dict[str, type] = {
    "rollcall": RollcallCosts,
    "launcher": LauncherCosts,
    "replica_groups": ReplicaGroupCosts,
    "fault_mix": MeasuredFaultMix,
}


def costs_from_dict(data: Mapping[str, Any]) -> Costs:
    """Read the shipped file's content back (``costs_to_dict``'s inverse)."""
    if data.get("schema") != SCHEMA:
        raise CostsUnreadable(f"not a costs file of schema {SCHEMA!r} "
                              f"(schema {data.get('schema')!r})")  # fmt: skip
    runs = data.get("runs")
    if not isinstance(runs, Mapping):
        raise CostsUnreadable("costs file: runs is not an object")
    parts: dict[str, Any] = {
        name: _from_plain(kind, data.get(name), name) for name, kind in _PARTS.items()
    }
    return Costs(
        rollcall=parts["rollcall"],
        launcher=parts["launcher"],
        replica_groups=parts["replica_groups"],
        pause_overhead=_measured_from(data.get("pause_overhead"), "pause_overhead"),
        fault_mix=parts["fault_mix"],
        runs=tuple((str(k), str(v)) for k, v in runs.items()),
    )


def cost_lines(costs: Costs, members: int | None = None) -> Sequence[tuple[str, str, str]]:
    """(what, value, source) for every cost, for printing; roll calls at
    ``members`` when given."""
    rc, la, rg = costs.rollcall, costs.launcher, costs.replica_groups
    n = members or rc.roll_call.members[0]
    note = " (extrapolated)" if rc.roll_call.extrapolated(n) else ""
    seconds = [
        ("rollcall: crash detection", rc.crash_detect),
        ("rollcall: group rebuild", rc.group_rebuild),
        ("rollcall: replacement start-up", rc.startup),
        ("rollcall: roll-call deadline", rc.roll_call_deadline),
        ("rollcall: evicted worker's exit after its pause", rc.exit_after_eviction),
        ("rollcall: state fetch, fixed", rc.transfer_fixed),
        ("launcher: crash detection", la.crash_detect),
        ("launcher: relaunch of every rank", la.relaunch),
        ("launcher: replacement reaches the rendezvous", la.join_arrival),
        ("launcher: rendezvous last call", la.round_window),
        ("replica groups: heartbeat timeout of the measured run", rg.heartbeat_setting),
        ("replica groups: quorum beyond the heartbeat timeout", rg.quorum_overhead),
        ("replica groups: survivors' stall while a group heals", rg.heal_stall),
        ("replica groups: replacement start-up", rg.startup),
        ("every system: a sat-out pause beyond its length", costs.pause_overhead),
    ]
    lines = [
        (f"rollcall: roll call at {n:,} members{note}", f"{rc.roll_call.at(n):.3f} s",
         rc.roll_call.source),
        (f"rollcall: join roll call at {n:,} members{note}",
         f"{rc.join_roll_call.at(n):.3f} s", rc.join_roll_call.source),
        ("rollcall: state fetch bandwidth", f"{rc.transfer_bandwidth.value / 1e6:.0f} MB/s",
         rc.transfer_bandwidth.source),
    ]  # fmt: skip
    lines += [(what, f"{m.value:.3f} s", m.source) for what, m in seconds]
    return lines
