"""``rollcall plan``'s answer as text: the settings chosen, the predicted
goodput and where the rest of the time goes, for rollcall and for a
restart-from-checkpoint launcher, and the notes that bound the answer."""

from __future__ import annotations

from rollcall.planning.costs import Costs, cost_lines
from rollcall.planning.job import FaultMix, Job
from rollcall.planning.plan import Plan, interval_steps
from rollcall.planning.timeline import LOSSES


def duration(seconds: float) -> str:
    """Seconds in the unit that reads best: 250 ms, 9.05 s, 12.5 min, 7.9 h, 42 d."""
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    if seconds < 172_800:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 86400:,.0f} d"


def size(nbytes: int) -> str:
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def plan_text(plan: Plan, job: Job, mix: FaultMix, costs: Costs, costs_from: str,
              seed: int, show_costs: bool = False) -> str:  # fmt: skip
    mtbf = plan.mtbf_s
    lines = [
        f"rollcall plan: {job.ranks:,} ranks, job MTBF {duration(mtbf)} (one rank's "
        f"{duration(mtbf * job.ranks)}), steps of {duration(job.step_s)}, checkpoint write "
        f"{duration(job.checkpoint_write_s)} / load {duration(job.checkpoint_load_s)}, "
        f"state {size(job.state_bytes)}",
        f"faults: {mix.silent_share:.0%} of failures silent (no TCP reset), "
        f"{mix.pauses_per_failure:g} pauses of healthy ranks per failure (lognormal, median "
        f"{duration(mix.pause_median_s)}, sigma {mix.pause_sigma:g}, at most "
        f"{duration(mix.pause_max_s)})",
        f"simulated: {plan.trace.failures:,} failures and {plan.trace.pauses:,} pauses over "
        f"{duration(plan.trace.horizon)} (seed {seed}); costs {costs_from}",
        "",
    ]
    r, la = plan.rollcall, plan.launcher
    width = 34
    header = f"{'':{width}}{'rollcall':>14}{'launcher (torchrun-like)':>28}"
    lines.append(header)

    def row(label: str, a: str, b: str) -> str:
        return f"{label:{width}}{a:>14}{b:>28}"

    lines.append(row("detector timeout", duration(r.timeout_s), duration(la.timeout_s)))
    lines.append(row("checkpoint every", f"{r.checkpoint_every:,} steps",
                     f"{la.checkpoint_every:,} steps"))  # fmt: skip
    lines.append(row("  that is", duration(r.checkpoint_every * job.step_s),
                     duration(la.checkpoint_every * job.step_s)))  # fmt: skip
    young_k = interval_steps(plan.young_s, job.step_s)
    daly_k = interval_steps(plan.daly_s, job.step_s)
    lines.append(row("  Young sqrt(2CM) / Daly", "", f"{duration(plan.young_s)} / "
                     f"{duration(plan.daly_s)}"))  # fmt: skip
    lines.append(row("", "", f"({young_k:,} / {daly_k:,} steps)"))
    ro, lo = r.outcome.breakdown, la.outcome.breakdown
    lines.append(row("predicted goodput", f"{ro.goodput:.4f}", f"{lo.goodput:.4f}"))
    for category in LOSSES:
        a, b = ro.share(category), lo.share(category)
        if a > 0 or b > 0:
            lines.append(row(f"  lost to {category.value}", f"{a:.4f}", f"{b:.4f}"))
    lines += [
        "",
        "rollcall keeps the launcher's checkpoint interval: its failures never need a",
        "checkpoint (live peers hold the state), which only bounds what losing every",
        "replica at once would cost, a case this model does not draw.",
    ]
    curve = costs.rollcall.roll_call
    if curve.extrapolated(job.ranks):
        lines += [
            f"rollcall's roll call at {job.ranks:,} members ({duration(curve.at(job.ranks))}) "
            f"is extrapolated from",
            f"view-change runs of at most {curve.members[-1]:,} members; one Python leader is "
            "not expected",
            "to serve that many (DESIGN.md, \"Scale\").",
        ]
    if show_costs:
        lines += ["", "costs (measured):"]
        lines += [f"  {what}: {value}  [{source}]" for what, value, source
                  in cost_lines(costs, job.ranks)]  # fmt: skip
    else:
        lines.append("--show-costs lists every measured cost used and the file and field it "
                     "came from.")  # fmt: skip
    return "\n".join(lines)
