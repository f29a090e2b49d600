"""The suite, by area (folders without an `__init__.py`: pytest imports the files with --import-mode=importlib):

- transport/: the wire header, packed alike by torch_bps/wire.py and cpp_ext/transport/wire.h;
- client/: the C++ push/pull client (sums, faults, flow control, the stream transport, the scheduler), driven through
  the door production uses (`Client.push_pull_batch`);
- server/: the summation server: the protocol by hand, rounds, limits, authentication, counters, streams;
- engine/: the worker-side engine: placement, partitioning, scheduling, the pipeline and the local stages;
- backend/: the "byteps" backend and bps_hook as torch uses them: collectives against gloo, DDP, FSDP;
- faults/: killed and stalled ranks and servers, failover, garbage on the wire, with real processes;
- e2e/: torchrun, rendezvous, the runtime, the timeline, the doctor and the emulated cluster;
- kernels/: triton_kernels against their torch references, and ahead-of-time compilation;
- deploy/, frameworks/, torch_suite/: the wheel and manifests, Lightning/Accelerate/Ignite, torch's own suite;
- gpu/: CUDA tests and the GPU check (`make gpu-test`, `make gpu-check`).

Shared by every folder: conftest.py (fixtures, the reaper), helpers.py (servers, raw peers, spawned ranks, the
recording stand-in for CUDA, a DDP pair on two groups); the training scripts the fault tests launch under torchrun
are in scripts/.
"""
