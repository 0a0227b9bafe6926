"""Every timeout, TTL and size limit of the control plane, in one typed place.

Call sites read these fields; they never carry literals of their own. All
durations are in seconds (floats), all sizes in bytes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from rollcall.membership.phi import earliest_suspicion


@dataclass(frozen=True)
class Config:
    """Control-plane settings with their documented defaults."""

    # --- failure detection -------------------------------------------------
    #: How often a member sends a heartbeat on its session stream.
    heartbeat_interval: float = 0.1
    #: Phi-accrual suspicion threshold: a member is suspected once
    #: phi = -log10(P(heartbeat still to come)) exceeds it. 8 means the
    #: detector is wrong about once in 10^8 intervals if the observed
    #: distribution holds.
    phi_threshold: float = 8.0
    #: Floor on the standard deviation of heartbeat intervals, so a very
    #: regular history does not make the detector hair-triggered. With the
    #: defaults a silent member is suspected ~1.5 s after its last heartbeat
    #: (100 ms + 5.6 x 250 ms), later when the observed jitter is larger.
    #: 0.25 rather than 0.1 (~0.66 s): under injected pauses and failures,
    #: 0.1 evicted ~4x more healthy workers and lost more goodput on each
    #: of 4 seeds (docs/faults.md, bench/results/detector-min-std/).
    phi_min_std: float = 0.25
    #: Heartbeats per second that the leader takes from all members
    #: together before it lengthens their interval: a view of more than
    #: ``heartbeat_interval x heartbeat_rate_max`` members is told to
    #: heartbeat every ``members / heartbeat_rate_max`` seconds, rounded up
    #: to half a ``heartbeat_interval``, up to ``heartbeat_interval_max``
    #: (``heartbeat_interval_for``). Each heartbeat costs the leader a read,
    #: the detector's update and an acknowledgement (docs/protocol.md,
    #: "Scaling").
    heartbeat_rate_max: float = 4000.0
    #: The longest interval the leader tells members to heartbeat at, and
    #: never more than a quarter of the detector's earliest suspicion. A
    #: worker applies a step only with the acknowledgement of a heartbeat
    #: sent within its ``fence_window``, so a member heartbeats at most every
    #: 0.6 x its own ``fence_window`` whatever it is told (the rest is the
    #: acknowledgement's way back). Below ``heartbeat_interval``: the interval
    #: never grows.
    heartbeat_interval_max: float = 0.3
    #: Heartbeat intervals remembered per member.
    phi_window: int = 100
    #: Silence after which a member is suspected whatever phi says. This is
    #: the detector's hard bound; phi normally fires much earlier.
    max_silence: float = 2.0

    #: A worker applies a step only if its session was never silent for
    #: longer than this while the step ran (a frozen or starved process may
    #: have been evicted meanwhile). Must stay below the detector's earliest
    #: suspicion (``earliest_suspicion()``, 1.40 s by default): checked here
    #: within one process, and by the worker against the service's bound,
    #: which the ``Join`` answer carries.
    fence_window: float = 0.5
    #: How long a step whose reduction completed waits for such an
    #: acknowledgement before it is dropped. A leader failover stops them
    #: for ``election_ttl`` and a reconnection: a member that gave up sooner
    #: would drop a step that members whose last acknowledgement was a
    #: little younger landed, and with sharded optimizer state the
    #: partitions only it and such members held would be lost. Past it, a
    #: member whose session is between leaders waits on until a leader
    #: answers (a failover can outlast any bound on a loaded machine). An
    #: evicted member does not wait: its session's end is an answer at once.
    fence_patience: float = 5.0

    # --- collectives and busy members ---------------------------------------
    #: How long a collective, or the build of a view's group, waits for a
    #: peer that did not declare itself busy before counting it as failed
    #: (the worker then reports it and a roll call follows). A frozen or
    #: dead peer is normally found much sooner by the detector.
    collective_timeout: float = 30.0
    #: Longest busy period a member may declare (``Elastic.busy``): its
    #: peers wait that long for it and the detector does not suspect it for
    #: silence meanwhile, so a worker that hangs while busy is found late.
    busy_max: float = 3600.0
    #: Busy period declared when ``Elastic.busy`` is given no timeout.
    busy_default: float = 600.0

    # --- roll call ---------------------------------------------------------
    #: How long a roll call waits for answers before deciding without the
    #: silent members (one held at the step's end, for joins and clean
    #: leaves, waits ``rollcall_step_end_wait`` longer: its answers may
    #: wait that long for the step to end).
    rollcall_deadline: float = 1.0
    #: A roll call held only for joiners and clean leaves aborts nothing:
    #: the members finish the step in flight and answer after it. One whose
    #: step does not end within this time (a long step, a busy period)
    #: aborts it, throwing its work away, and answers as for any roll call.
    #: A job whose steps take longer sets it above its step time (the
    #: worker warns when it gives a step up): such roll calls then wait
    #: that much longer for their answers (``answer_deadline``).
    rollcall_step_end_wait: float = 0.5
    #: After a join request, wait this long for more joiners so that a burst
    #: of arrivals becomes one view change instead of many.
    join_settle: float = 0.05
    #: A member id handed out by Join must open its session within this time
    #: or it is dropped.
    join_session_timeout: float = 10.0

    #: Roll calls that one member's failure reports (naming a peer, or the
    #: member itself to ask for one) may start in a row; after that one more
    #: per ``report_interval``. Reports over the limit are ignored (logged
    #: once), so a member flooding them costs at most
    #: ``report_burst + t / report_interval`` view changes in ``t`` seconds.
    report_burst: int = 3
    #: See ``report_burst``: seconds per further roll call a member's
    #: reports may start once its burst is spent.
    report_interval: float = 5.0

    #: More members than this on sessions of their own (not on a host
    #: agent's shared stream) and the leader says, once, that their hosts
    #: should run ``rollcall agent``: on 2 cores one leader saturated at
    #: about 500 such members (docs/protocol.md, "Shared sessions").
    own_sessions_advised: int = 256

    # --- etcd --------------------------------------------------------------
    #: TTL of each member's etcd lease. The leader refreshes it while the
    #: member's session is healthy; it must outlive a leader failover.
    member_lease_ttl: int = 10
    #: TTL of the leader's election lease: how long a dead leader blocks a
    #: standby from taking over.
    election_ttl: int = 2
    #: Timeout of one etcd request.
    etcd_timeout: float = 2.0
    #: Timeout of etcd's Authenticate (a token for --etcd-user, fetched once
    #: and again when etcd drops it): etcd checks the password with bcrypt,
    #: which takes seconds on a loaded machine (2.5 s seen on 2 cores).
    etcd_auth_timeout: float = 10.0
    #: After taking over, a new leader waits this long for members of the
    #: current view to reconnect before suspecting the ones that did not.
    takeover_grace: float = 3.0
    #: Progress (last committed step) is written to etcd at most this often.
    progress_write_interval: float = 0.5
    #: A replica that refuses to lead because etcd holds a malformed view of
    #: its job reads the view again this often (it says why only once).
    refusal_retry: float = 2.0
    #: A new leader asks a member of the view that did not reconnect within
    #: ``takeover_grace`` whether its process is alive; no answer within
    #: this time counts as dead (``rollcall.rendezvous.probe``).
    member_probe_timeout: float = 1.0

    #: Durable checkpoint manifests kept in etcd (newest first); a writer
    #: deletes the files they no longer name once a newer one it verified
    #: is kept (worker/checkpoint.py).
    checkpoint_keep: int = 3
    #: ``PublishCheckpoint`` refuses a manifest whose step is more than one
    #: past the job's progress, after waiting at most this long for the
    #: progress to get there (the writer's own progress report may arrive
    #: just after its publication).
    checkpoint_progress_wait: float = 2.0

    # --- request limits ----------------------------------------------------
    #: Largest gRPC message accepted by the service.
    max_message_bytes: int = 64 * 1024
    #: Member ids and job names: length bound (charset is fixed, see
    #: ``rollcall.protocol.validation``).
    max_id_length: int = 64
    #: Longest ``host:port`` address accepted.
    max_address_length: int = 255
    #: Longest state digest accepted in a roll-call answer.
    max_digest_length: int = 128

    # --- client ------------------------------------------------------------
    #: Client back-off between attempts on the replica list, doubling from
    #: ``client_retry_initial`` up to ``client_retry_max``; also gRPC's own
    #: back-off between connection attempts to one replica.
    client_retry_initial: float = 0.05
    client_retry_max: float = 1.0
    #: One attempt of an RPC on one replica gives up after this long (less
    #: when ``client_call_deadline`` is nearer), so that a replica that
    #: holds a call without answering does not use up the whole deadline.
    client_attempt_timeout: float = 10.0
    #: The client's channels ping an idle connection this often, so that a
    #: replica whose host vanished is noticed on a connection left open.
    client_keepalive_interval: float = 10.0
    #: A replica must answer a session's Open within this time, or the
    #: client moves on to the next one (a replica whose host vanished does
    #: not reset the connection). Must stay below ``takeover_grace``.
    session_open_timeout: float = 1.0
    #: Give up on an RPC after trying the replicas for this long.
    client_call_deadline: float = 30.0
    #: A worker keeps trying to join for this long (the service may come up
    #: after the workers, as under docker-compose) before giving up.
    join_deadline: float = 900.0
    #: While the service cannot be reached, a joining worker says so after
    #: this long and again at this interval.
    unreachable_notice: float = 5.0

    # --- internal pacing ---------------------------------------------------
    # How often things are looked at: none of these decides an outcome, each
    # bounds how late a change is noticed (and what the looking costs).
    #: The training thread looks at the abort (a roll call, a failed peer)
    #: this often while it waits for the control thread.
    abort_poll: float = 0.005
    #: The etcd store waits at most this long for a connection it found
    #: failed to come back before trying it again: a little more than gRPC's
    #: longest reconnect back-off (``etcd_reconnect_backoff_max``, +20 %
    #: jitter).
    etcd_reconnect_wait: float = 0.25
    #: An etcd watch checks this often whether the store's requests to its
    #: endpoint failed meanwhile (then it moves to another endpoint).
    etcd_watch_health_interval: float = 0.25
    #: An etcd watch that broke is opened again after this long, doubling
    #: up to ``etcd_watch_backoff_max``.
    etcd_watch_backoff_initial: float = 0.1
    etcd_watch_backoff_max: float = 1.0
    #: Closing the store waits this long for each watch's thread to end.
    etcd_close_wait: float = 1.0
    #: gRPC tries a refused connection to an etcd endpoint again after
    #: this long, doubling up to ``etcd_reconnect_backoff_max``, so that a
    #: restarted etcd is found again at once (gRPC's own default backs off
    #: up to two minutes); on loopback or a LAN that is one SYN per endpoint
    #: every 200 ms while it is down.
    etcd_reconnect_backoff_initial: float = 0.05
    etcd_reconnect_backoff_max: float = 0.2
    #: The etcd channels ping the server this often, and close a connection
    #: whose ping is not answered within ``etcd_keepalive_timeout``: a frozen
    #: or unreachable server under a long-lived watch stream is detected
    #: after about their sum (15 s). etcd refuses pings more often than
    #: every 5 s (its --grpc-keepalive-min-time).
    etcd_keepalive_interval: float = 10.0
    etcd_keepalive_timeout: float = 5.0
    #: Every replica reads the view (and the job's record) this often, as a
    #: backstop for the watch, which is lost while etcd is down.
    view_poll_interval: float = 1.0
    #: The events file gets a view change's record once every member
    #: reported its first step in the view, or after this long without.
    event_timeout: float = 30.0
    #: The events file gets a progress record (the job's step) at most this
    #: often.
    progress_event_interval: float = 1.0
    #: A worker's ledger file is fsynced at most this often (``--ledger``):
    #: a crash of the machine loses at most this long of records.
    ledger_sync_interval: float = 1.0
    #: A ledger file another process holds is waited for this long before
    #: the worker is refused: a restarted worker's former self may still be
    #: going (a process it forked outlives it by a few seconds).
    ledger_lock_wait: float = 10.0
    #: A state transfer call that a peer refused because it has not caught
    #: up with the view yet (or could not be reached) is tried again after
    #: this long, doubling up to ``transfer_retry_max``, until the
    #: transfer's own deadline.
    transfer_retry_initial: float = 0.005
    transfer_retry_max: float = 0.1
    #: Once one source of a state fetch has described the state, the
    #: others get this much longer to answer; one that has not is left out
    #: of the fetch (a holder that died must not hold it up).
    transfer_describe_grace: float = 0.1
    #: Shortest timeout a state transfer call is given, even when its
    #: transfer's deadline is nearer (a call with no time at all would fail
    #: without asking the peer).
    transfer_min_call_timeout: float = 0.1
    #: Every this many steps the ranks of a replicated job compare the
    #: digests of their states (one collective of two integers, and a
    #: digest of the state per rank: ~2 ms for the example's 1.7 MB, ~0.3 s
    #: for 306 MB on 2 cores); replicas that differ, which nothing in a step
    #: shows, ask for a roll call whose most common state the others take
    #: (docs/worker.md, "Replicas that drift"). Part of the job's
    #: fingerprint (every rank must make the same collectives); a value
    #: above the run's steps turns it off.
    drift_check_every: int = 100
    #: A state fetch keeps this many data connections open at once, spread
    #: over its sources (at least one each), each asking for one unit of
    #: about ``transfer_unit_bytes`` at a time; a faster source takes more
    #: units. Four connections moved state fastest here (2 cores, loopback).
    transfer_streams: int = 4
    transfer_unit_bytes: int = 4 << 20
    #: A state of at most this many bytes is sent whole in the answer to
    #: the fetcher's first ``Describe``: one round trip instead of the data
    #: channel's set-up (its connection, challenge, header and piece list),
    #: which at the example's 1.7 MB cost more than the bytes. Checked
    #: against the agreed digest like any fetch; a state that fails it is
    #: fetched again piece by piece.
    transfer_whole_bytes: int = 4 << 20
    #: A data connection that moves no byte for this long is given up (its
    #: unit goes to another source); also the bound on each of its steps
    #: (connect, handshake) at either end.
    transfer_stall_timeout: float = 5.0
    #: A state server closes its data listener after this long without a
    #: connection, and opens it again (on another port) when asked again.
    transfer_listener_idle: float = 60.0
    #: Data connections a state server serves at once; more are refused.
    transfer_max_connections: int = 32
    #: Closing a microbatch loader waits this long for each loader process
    #: it had to kill (one stuck in user code) to end.
    loader_kill_wait: float = 1.0

    #: ``Elastic(overlap=True)``: the most bytes of gradients reduced as one
    #: bucket (``rollcall.worker.overlap``). Smaller buckets start sooner
    #: during the backward pass; each costs a collective of its own.
    overlap_bucket_bytes: int = 25 * 1024 * 1024

    #: Python's thread switch interval from a roll call's arrival until the
    #: first step of the next view commits (``rollcall.worker.switching``):
    #: the runtime's own threads (the answer, the session, the group's
    #: build) then get the GIL from a computing training thread within this,
    #: instead of the interpreter's 5 ms. Put back as it was afterwards.
    view_change_switch_interval: float = 0.0005

    # --- the gloo group (``rollcall.worker.group``) --------------------------
    #: A blocked wait of the group (its bootstrap store, its build, a
    #: collective) looks at the abort this often: the bound on how late an
    #: abort is noticed. Completions wake the waiter at once, so this costs
    #: no latency on the success path.
    group_abort_poll: float = 0.01
    #: How long an aborted collective is given to end once its connections
    #: are shut down (it ends within milliseconds; longer means the sockets
    #: were not all found, or gloo left a work waiting, and the group is
    #: left to end with the process), looked at every
    #: ``group_abort_settle_poll``. It is on the path of the view change
    #: (the training thread enters the next view after it): 1 s was seen
    #: whole in about one view change in ten on 2 cores (bench/README.md).
    group_abort_settle: float = 0.1
    group_abort_settle_poll: float = 0.001
    #: How long past its own timeout an abandoned group or build is still
    #: expected to end. One that has not is stuck for good (a store request
    #: to a frozen host never times out) and is no longer waited for.
    group_park_grace: float = 2.0
    #: Longest single TCP connect attempt while a rank probes for the
    #: bootstrap store's listener, and the pause between two attempts.
    group_store_probe_attempt: float = 0.5
    group_store_probe_interval: float = 0.1
    #: How often a rank waiting at the bootstrap store for the others looks
    #: again. Ranks arrive within milliseconds of each other and every
    #: rank's build waits for the last look, so this is short (each look is
    #: one loopback round trip); an abort is still seen at the same looks.
    group_meet_poll: float = 0.001

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, (int, float)) and (math.isnan(value) or value <= 0):
                raise ValueError(f"config {field.name} must be positive, got {value!r}")
        if self.election_ttl < 2:
            raise ValueError("config election_ttl must be at least 2 s (etcd's minimum lease)")
        if self.session_open_timeout >= self.takeover_grace:
            raise ValueError(
                "config session_open_timeout must be below takeover_grace, or members "
                "stuck on a vanished replica miss the new leader's grace period"
            )
        if self.busy_default > self.busy_max:
            raise ValueError(
                f"config busy_default ({self.busy_default}) must not exceed "
                f"busy_max ({self.busy_max})"
            )
        if self.fence_patience < self.election_ttl + self.session_open_timeout:
            raise ValueError(
                f"config fence_patience ({self.fence_patience:g} s) must cover a leader "
                f"failover (election_ttl + session_open_timeout = "
                f"{self.election_ttl + self.session_open_timeout:g} s), or a failover drops "
                "steps on some members that others land"
            )
        if self.fence_window >= self.earliest_suspicion():
            raise ValueError(
                f"config fence_window ({self.fence_window:g} s) must be below the detector's "
                f"earliest suspicion ({self.earliest_suspicion():.4g} s, set by "
                "phi_threshold, phi_min_std and max_silence), or a worker could "
                "apply a step after its eviction"
            )
        for initial, maximum in (
            ("client_retry_initial", "client_retry_max"),
            ("etcd_watch_backoff_initial", "etcd_watch_backoff_max"),
            ("etcd_reconnect_backoff_initial", "etcd_reconnect_backoff_max"),
            ("transfer_retry_initial", "transfer_retry_max"),
        ):
            if getattr(self, initial) > getattr(self, maximum):
                raise ValueError(f"config {initial} must not exceed {maximum}")
        if self.etcd_reconnect_wait <= self.etcd_reconnect_backoff_max:
            raise ValueError(
                "config etcd_reconnect_wait must exceed etcd_reconnect_backoff_max, or a "
                "failed etcd connection may not be tried again before the store gives up on it"
            )
        for poll, bound in (
            ("group_abort_poll", "collective_timeout"),
            ("group_store_probe_interval", "collective_timeout"),
            ("group_meet_poll", "collective_timeout"),
            ("group_abort_settle_poll", "group_abort_settle"),
        ):
            if getattr(self, poll) >= getattr(self, bound):
                raise ValueError(f"config {poll} must be below {bound}, which it polls within")
        if self.member_lease_ttl <= self.election_ttl + self.takeover_grace:
            raise ValueError(
                "config member_lease_ttl must exceed election_ttl + takeover_grace, "
                "or a leader failover would let live members' leases expire"
            )

    def earliest_suspicion(self) -> float:
        """Shortest silence after which the detector may suspect a member,
        whatever its heartbeat history (``rollcall.membership.detector``): about
        5.6 x ``phi_min_std``, at most ``max_silence``."""
        return earliest_suspicion(self.phi_threshold, self.phi_min_std, self.max_silence)

    def service_timing(self) -> dict[str, float]:
        """The rendezvous service's timing settings that a member checks
        against its own (``ServiceTiming``, the ``JoinResponse``), by their
        names there."""
        return {
            "earliest_suspicion_s": self.earliest_suspicion(),
            "rollcall_deadline_s": self.rollcall_deadline,
            "rollcall_step_end_wait_s": self.rollcall_step_end_wait,
            "election_ttl_s": self.election_ttl,
        }

    def heartbeat_interval_for(self, members: int) -> float:
        """The heartbeat interval for a view of ``members``: ``heartbeat_interval``
        until the heartbeats of all of them would exceed
        ``heartbeat_rate_max`` per second, then longer, in steps of half a
        ``heartbeat_interval`` (so that a view growing or shrinking by a few
        members does not change it), up to ``heartbeat_interval_max`` and a
        quarter of the earliest suspicion, never below ``heartbeat_interval``."""
        needed = members / self.heartbeat_rate_max
        if needed <= self.heartbeat_interval:
            return self.heartbeat_interval
        step = self.heartbeat_interval / 2
        stepped = round(step * math.ceil(needed / step - 1e-9), 6)
        longest = min(self.heartbeat_interval_max, self.earliest_suspicion() / 4)
        return max(self.heartbeat_interval, min(stepped, longest))

    def detection_bound(self) -> float:
        """Longest time from a member's last heartbeat to its suspicion."""
        return self.max_silence

    def answer_deadline(self, at_step_end: bool) -> float:
        """How long after a roll call starts its answers may come: one held
        at the step's end (joins, clean leaves) may wait that long for the
        step to end first (``rollcall_step_end_wait``)."""
        return self.rollcall_deadline + (self.rollcall_step_end_wait if at_step_end else 0.0)

    def eviction_bound(self) -> float:
        """Longest time from a member's last heartbeat to a committed view
        without it (detection, then a roll call that waits at most its
        deadline)."""
        return self.max_silence + self.join_settle + self.rollcall_deadline

    def collective_backstop(self) -> float:
        """gloo's own timeout per collective: only reached if the runtime's
        patience (``collective_timeout``, extended for busy peers) somehow
        did not end the wait first."""
        return self.collective_timeout + self.busy_max

    def replace(self, **changes: object) -> Config:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
