"""The rendezvous replica's parts, one concern each, put together by
``rollcall.rendezvous.service.Replica``:

- ``leadership``: what the leader holds (its policy, records, sessions);
- ``base``: the replica's state and the checks every request gets;
- ``actions``: the leader's decisions carried out (commits, evictions,
  announcements, progress writes), and the loop that drives its policy;
- ``election``: winning, holding and giving back leadership, etcd outages
  and lost data, a standby's view of the record;
- ``sessions``: the members' session streams;
- ``checkpoints``: the checkpoint record's RPCs and durability failures;
- ``calls``: ``Join``, ``Leave``, ``Status`` and ``Watch``.
"""
