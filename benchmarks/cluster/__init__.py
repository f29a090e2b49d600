"""The emulated cluster: workers and summation servers as network namespaces behind shaped links.

`python -m benchmarks.cluster --quick` builds the cluster (root only), calibrates a link, measures gloo
all_reduce and torch_bps push/pull per number of server hosts k next to the paper's section 4.1 theory,
and DDP samples/s with gloo vs the "byteps" backend. See `cli.py` for the options, `topology.py` for the
network, `byteps.py` for the pluggable torch_bps runner.

Importing this package is cheap (no torch): the worker programs under `workers/` share it.
"""
