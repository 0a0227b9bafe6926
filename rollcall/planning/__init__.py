"""Planning a job under churn: a discrete-event simulator of a training job
whose ranks fail and pause, for rollcall, a restart-from-checkpoint launcher
(torchrun-like) and a per-replica-group system (TorchFT-like), and the search
behind ``rollcall plan``. Pure code: no I/O and no clock; randomness comes
from a generator passed in.

- ``errors``: what can be wrong with the inputs, as named errors;
- ``job``: the job, the host it runs on and the fault mix (inputs);
- ``costs``: the measured costs, turned from the benchmarks' JSON into typed
  values that name their file and field;
- ``trace``: faults in time (failures and pauses), drawn or scripted;
- ``timeline``: progress, checkpoints and where the time went;
- ``engine``: the event loop and slot bookkeeping shared by the systems;
- ``systems``: how each system reacts to a fault;
- ``simulate``: one run of one system over one trace;
- ``plan``: Young/Daly and the search for the detector timeout and the
  checkpoint interval; ``text``: its answer as ``rollcall plan`` prints it;
- ``validation``: the real runs (bench/peers.py churn, bench/detector_sweep.py)
  as simulation cases, to compare with what they measured.
"""
