"""rollcall.membership.continuity: telling an etcd that lost the job's data from one
that merely moved on."""

from __future__ import annotations

from rollcall.membership.continuity import Continuity, EtcdPosition


def seen(cluster: int = 0xA, revision: int = 100, epoch: int = 5) -> Continuity:
    continuity = Continuity()
    continuity.advance(EtcdPosition(cluster, revision, epoch))
    return continuity


def test_a_first_observation_is_accepted() -> None:
    assert Continuity().lost(EtcdPosition(0xA, 1, 0)) is None


def test_moving_forward_is_not_a_loss() -> None:
    assert seen().lost(EtcdPosition(0xA, 101, 5)) is None
    assert seen().lost(EtcdPosition(0xA, 100, 6)) is None


def test_a_new_cluster_id_is_a_loss_even_if_it_looks_ahead() -> None:
    reason = seen().lost(EtcdPosition(0xB, 500, 9))
    assert reason is not None and "cluster id changed from a to b" in reason


def test_an_epoch_going_back_is_a_loss() -> None:
    reason = seen().lost(EtcdPosition(0xA, 200, 0))
    assert reason == "etcd holds no view of the job, and this replica saw epoch 5"
    reason = seen().lost(EtcdPosition(0xA, 200, 3))
    assert reason == "etcd holds epoch 3 of the job, and this replica saw epoch 5"


def test_a_revision_going_back_is_a_loss() -> None:
    reason = seen().lost(EtcdPosition(0xA, 40, 5))
    assert reason == "etcd's revision went from 100 back to 40"


def test_an_epoch_seen_by_other_means_counts() -> None:
    continuity = seen(epoch=5)
    continuity.saw_epoch(8)
    assert continuity.lost(EtcdPosition(0xA, 120, 7)) is not None


def test_rebase_accepts_the_restored_history_from_then_on() -> None:
    continuity = seen(revision=100, epoch=5)
    continuity.rebase(EtcdPosition(0xB, 3, 5))
    assert continuity.lost(EtcdPosition(0xB, 4, 5)) is None
    assert continuity.lost(EtcdPosition(0xB, 4, 4)) is not None


def test_an_answer_sent_before_a_newer_observation_is_stale_not_judged() -> None:
    continuity = seen(revision=2, epoch=0)
    early = continuity.ticket()  # a standby's poll, answered at revision 2
    late = continuity.ticket()  # the takeover's read, answered at revision 3, judged first
    assert not continuity.stale(late)
    continuity.advance(EtcdPosition(0xA, 3, 0))
    assert continuity.stale(early)
    assert continuity.stale(continuity.ticket()) is False


def test_an_epoch_seen_meanwhile_makes_a_read_in_flight_stale() -> None:
    continuity = seen(epoch=5)
    ticket = continuity.ticket()
    continuity.saw_epoch(6)  # the watch delivers epoch 6 while etcd is read
    assert continuity.stale(ticket)
    assert continuity.lost(EtcdPosition(0xA, 100, 5)) is not None  # what it would have said


def test_seeing_nothing_new_leaves_reads_in_flight_judgeable() -> None:
    continuity = seen(revision=100, epoch=5)
    ticket = continuity.ticket()
    continuity.saw_epoch(4)
    continuity.advance(EtcdPosition(0xA, 100, 5))
    assert not continuity.stale(ticket)
