"""How each system reacts to a failure and to a pause, as events on the
engine. Every reaction takes its durations from the measured ``Costs``; the
only modelled quantities are the aborted step (half a step lost on average,
where a step in flight is thrown away) and the job's own settings.

- rollcall: survivors stay. A crash is noticed by its TCP reset, a silent
  failure after the detector's timeout; then one view change (roll call at
  the job's member count, group rebuild, the aborted step). The replacement
  joins with another view change, in which it fetches the state. A pause
  shorter than the timeout holds everyone up for its length; a longer one
  gets its rank evicted (the timeout, a view change, and a replacement once
  the paused process exits). A roll call drops a member that stays paused
  past the roll-call deadline. With no member left, the next joiner resumes
  from the last checkpoint.
- launcher (torchrun-like): any change of membership stops every rank,
  re-rendezvous, relaunches and resumes from the last checkpoint, replaying
  the steps since. A replacement that reaches the rendezvous while a round
  is open (detection plus the last-call window) is in it; later, it costs
  another restart. A pause past the timeout trips the collective's timeout:
  a restart, and the paused rank rejoins when it wakes.
- replica groups (TorchFT-like): a failed rank takes its replica group out;
  the survivors wait for the heartbeat timeout (crash or not) and the
  quorum, then train on without that group's samples (nothing replayed).
  The group comes back when its replacement has started and healed from a
  peer (the survivors stall briefly). A pause past the timeout drops the
  group until the pause ends and it heals.
"""

from __future__ import annotations

import itertools

from rollcall.planning.costs import Costs
from rollcall.planning.engine import Engine, Slot
from rollcall.planning.job import Host, Job, System
from rollcall.planning.timeline import Category
from rollcall.planning.trace import Failure, FailureKind, Pause, Trace

EMPTY = ("no member left",)


class RollcallJob(Engine):
    def __init__(self, job: Job, host: Host, costs: Costs, timeout: float, trace: Trace) -> None:
        super().__init__(job, host, costs, timeout, trace)
        self.c = costs.rollcall
        self.members = job.ranks
        #: Members that are paused, and when each resumes.
        self._paused: dict[int, float] = {}
        self._views_free_at = 0.0
        self._views = itertools.count()

    # ------------------------------------------------------------------ faults

    def on_failure(self, failure: Failure) -> None:
        slot = self.ready_slot(failure.slot)
        if slot is None:
            return
        self.failures_hit += 1
        self.out[slot] = Slot.FAILED
        crash = failure.kind is FailureKind.CRASH
        detect = self.c.crash_detect.value if crash else self.timeout
        self.hold(("detect", slot), Category.DETECTION, self.now + detect)
        self.at(self.now + detect, self._drop, slot, Category.RECONFIGURATION,
                self.now if crash else None)  # fmt: skip

    def on_pause(self, pause: Pause) -> None:
        slot = self.ready_slot(pause.slot)
        if slot is None:
            return
        self.pauses_hit += 1
        resume = self.now + pause.seconds
        self.out[slot] = Slot.PAUSED
        self._paused[slot] = resume
        if pause.seconds < self.timeout:
            self.hold(("pause", slot), Category.PAUSES, resume + self.costs.pause_overhead.value)
            self.at(resume, self._resume, slot, resume)
        else:
            self.hold(("pause", slot), Category.FALSE_EVICTION, self.now + self.timeout)
            self.at(self.now + self.timeout, self._detector_evicts, slot)

    # ----------------------------------------------------------- consequences

    def _resume(self, slot: int, resume: float) -> None:
        if self._paused.get(slot) == resume:
            del self._paused[slot]
            self.out.pop(slot, None)

    def _detector_evicts(self, slot: int) -> None:
        resume = self._paused.pop(slot, None)
        if resume is None:
            return  # a roll call dropped it already
        self.out[slot] = Slot.EVICTED
        self._drop(slot, Category.FALSE_EVICTION, resume + self.c.exit_after_eviction.value)

    def _drop(self, slot: int, category: Category, gone_at: float | None) -> None:
        """A view change without ``slot``, and its replacement once the
        process is gone (``None``: gone when the view is committed)."""
        self.members -= 1
        cost = (self.c.roll_call.at(self.members) + self.c.group_rebuild.value
                + self.job.step_s / 2)  # fmt: skip
        end = self._view_change(category, cost)
        self._removed(slot, category, end if gone_at is None else gone_at)

    def _removed(self, slot: int, category: Category, gone_at: float) -> None:
        if self.members == 0:
            self.timeline.block(EMPTY, category)
        self._capacity()
        self.at(gone_at + self.host.replace_after_s, self._replace, slot, category)

    def _replace(self, slot: int, category: Category) -> None:
        self.out[slot] = Slot.STARTING
        self.at(self.now + self.c.startup.value, self._join, slot, category)

    def _join(self, slot: int, category: Category) -> None:
        cost = (self.c.join_roll_call.at(self.members + 1) + self.c.group_rebuild.value
                + self.c.transfer_s(self.job.state_bytes) + self.job.step_s / 2)  # fmt: skip
        if self.members == 0:
            # Nobody holds the state: it comes from the last checkpoint.
            cost += self.job.checkpoint_load_s - self.c.transfer_s(self.job.state_bytes)
            self.timeline.restore()
            self.release(EMPTY)
        end = self._view_change(category, cost)
        self.members += 1
        self.at(end, self._joined, slot)

    def _joined(self, slot: int) -> None:
        if self.out.get(slot) is Slot.STARTING:
            del self.out[slot]
        self._capacity()

    def _view_change(self, category: Category, cost: float) -> float:
        """One roll call and what follows, after any under way; paused
        members that cannot answer within the deadline are dropped."""
        start = max(self.now, self._views_free_at)
        end = start + cost
        deadline = self.c.roll_call_deadline.value
        for slot, resume in list(self._paused.items()):
            if resume - start > deadline:
                del self._paused[slot]
                self.out[slot] = Slot.EVICTED
                self.members -= 1
                self.release(("pause", slot))
                end = max(end, start + deadline + cost)
                self.hold_once(Category.FALSE_EVICTION, end)
                self._removed(slot, Category.FALSE_EVICTION,
                              resume + self.c.exit_after_eviction.value)  # fmt: skip
            else:
                end = max(end, resume + self.c.group_rebuild.value)
        self._views_free_at = end
        self.hold(("view", next(self._views)), category, end)
        return end

    def _capacity(self) -> None:
        self.timeline.capacity = self.host.capacity(self.members, self.job.ranks)


class LauncherJob(Engine):
    def __init__(self, job: Job, host: Host, costs: Costs, timeout: float, trace: Trace) -> None:
        super().__init__(job, host, costs, timeout, trace)
        self.c = costs.launcher
        self.nodes = job.ranks
        self._restarts = 0
        self._restarting = False
        self._round_closes = -1.0

    def on_failure(self, failure: Failure) -> None:
        slot = self.ready_slot(failure.slot)
        if slot is None:
            return
        self.failures_hit += 1
        self.out[slot] = Slot.FAILED
        self.nodes -= 1
        crash = failure.kind is FailureKind.CRASH
        detect = self.c.crash_detect.value if crash else self.timeout
        self._restart(detect, Category.DETECTION, Category.RECONFIGURATION)
        gone = self.now if crash else self.now + detect
        self.at(gone + self.host.replace_after_s, self._replace, slot, Category.RECONFIGURATION)

    def on_pause(self, pause: Pause) -> None:
        if self._restarting:
            return  # a hiccup while everyone relaunches holds nobody up
        slot = self.ready_slot(pause.slot)
        if slot is None:
            return
        self.pauses_hit += 1
        if pause.seconds < self.timeout:
            self.out[slot] = Slot.PAUSED
            resume = self.now + pause.seconds
            self.hold(("pause", slot), Category.PAUSES, resume + self.costs.pause_overhead.value)
            self.at(resume, self._resume, slot)
        else:
            self.out[slot] = Slot.EVICTED
            self.nodes -= 1
            self._restart(self.timeout, Category.FALSE_EVICTION, Category.FALSE_EVICTION)
            self.at(self.now + pause.seconds, self._arrive, slot, Category.FALSE_EVICTION)

    def _resume(self, slot: int) -> None:
        if self.out.get(slot) is Slot.PAUSED:
            del self.out[slot]

    def _restart(self, detect: float, noticing: Category, category: Category) -> None:
        """Stop everyone, rendezvous, relaunch, load the last checkpoint."""
        self.timeline.restore()
        self._restarts += 1
        self._restarting = True
        self._round_closes = self.now + detect + self.c.round_window.value
        ready = self.now + detect + self.c.relaunch.value + self.job.checkpoint_load_s
        self.release(("restart",))
        self.release(("noticing",))
        self.hold(("noticing",), noticing, self.now + detect)
        self.at(self.now + detect, self._relaunch, self._restarts, category, ready)

    def _relaunch(self, number: int, category: Category, ready: float) -> None:
        if number == self._restarts:
            self.hold(("restart",), category, ready)
            self.at(ready, self._restarted, number, category)

    def _restarted(self, number: int, category: Category) -> None:
        if number != self._restarts:
            return  # a later restart replaced this one
        self._restarting = False
        if self.nodes == 0:
            self.timeline.block(EMPTY, category)
        self.timeline.capacity = self.host.capacity(self.nodes, self.job.ranks)

    def _replace(self, slot: int, category: Category) -> None:
        self.out[slot] = Slot.STARTING
        self.at(self.now + self.c.join_arrival.value, self._arrive, slot, category)

    def _arrive(self, slot: int, category: Category) -> None:
        """A rank reaches the rendezvous: in the open round, or a restart."""
        self.out.pop(slot, None)
        self.nodes += 1
        if self._restarting and self.now <= self._round_closes:
            return
        self.release(EMPTY)
        self._restart(0.0, category, category)


class ReplicaGroupJob(Engine):
    def __init__(self, job: Job, host: Host, costs: Costs, timeout: float, trace: Trace) -> None:
        super().__init__(job, host, costs, timeout, trace)
        self.c = costs.replica_groups
        self.live_groups = job.groups
        #: Groups out of the quorum (or healing), by group number.
        self._down: set[int] = set()

    def ready(self, slot: int) -> bool:
        return slot not in self.out and slot // self.job.replica_group not in self._down

    def on_failure(self, failure: Failure) -> None:
        slot = self.ready_slot(failure.slot)
        if slot is None:
            return
        self.failures_hit += 1
        group = slot // self.job.replica_group
        self._down.add(group)
        self.out[slot] = Slot.FAILED
        # The lighthouse drops a group when its heartbeats stop, crash or not.
        self.hold(("detect", group), Category.DETECTION, self.now + self.timeout)
        self.at(self.now + self.timeout, self._drop, Category.RECONFIGURATION)
        crash = failure.kind is FailureKind.CRASH
        gone = self.now if crash else self.now + self.timeout
        back = gone + self.host.replace_after_s + self.c.startup.value
        # A group heals only after the quorum dropped it.
        self.at(max(back, self.now + self.timeout), self._heal, group, slot,
                Category.RECONFIGURATION)  # fmt: skip

    def on_pause(self, pause: Pause) -> None:
        slot = self.ready_slot(pause.slot)
        if slot is None:
            return
        self.pauses_hit += 1
        self.out[slot] = Slot.PAUSED
        resume = self.now + pause.seconds
        if pause.seconds < self.timeout:
            self.hold(("pause", slot), Category.PAUSES, resume + self.costs.pause_overhead.value)
            self.at(resume, self._resume, slot)
        else:
            group = slot // self.job.replica_group
            self._down.add(group)
            self.hold(("pause", slot), Category.FALSE_EVICTION, self.now + self.timeout)
            self.at(self.now + self.timeout, self._drop, Category.FALSE_EVICTION)
            self.at(resume, self._heal, group, slot, Category.FALSE_EVICTION)

    def _resume(self, slot: int) -> None:
        if self.out.get(slot) is Slot.PAUSED:
            del self.out[slot]

    def _drop(self, category: Category) -> None:
        self.live_groups -= 1
        self.hold_once(category, self.now + self.c.quorum_overhead.value + self.job.step_s / 2)
        if self.live_groups == 0:
            self.timeline.block(EMPTY, category)
        self._capacity()

    def _heal(self, group: int, slot: int, category: Category) -> None:
        if self.live_groups == 0:
            # No replica holds the state: everyone resumes from the checkpoint.
            self.timeline.restore()
            self.release(EMPTY)
            fetch = self.job.checkpoint_load_s
            self.hold_once(category, self.now + fetch)
        else:
            fetch = self.costs.rollcall.transfer_s(self.job.state_bytes)
            self.hold_once(category, self.now + self.c.heal_stall.value)
        self.at(self.now + fetch, self._healed, group, slot)

    def _healed(self, group: int, slot: int) -> None:
        self._down.discard(group)
        self.out.pop(slot, None)
        self.live_groups += 1
        self._capacity()

    def _capacity(self) -> None:
        self.timeline.capacity = self.host.capacity(self.live_groups, self.job.groups)


ENGINES: dict[System, type[Engine]] = {
    System.ROLLCALL: RollcallJob,
    System.LAUNCHER: LauncherJob,
    System.REPLICA_GROUPS: ReplicaGroupJob,
}
