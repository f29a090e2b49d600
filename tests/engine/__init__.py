"""Tests of the worker-side engine: placement, partitioning, scheduling, the pipeline and the local stages."""
