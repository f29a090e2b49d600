"""Tests of the "byteps" backend and bps_hook as torch uses them: collectives against gloo, DDP, FSDP."""
