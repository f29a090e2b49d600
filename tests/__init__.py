"""The suite, by area: transport/, server/, engine/, backend/, faults/, e2e/, kernels/ (and gpu/, `make gpu-test`).

Shared by every folder: conftest.py (fixtures, the reaper), helpers.py (servers, raw peers, spawned ranks); the
training scripts the fault tests launch under torchrun are in scripts/.
"""
