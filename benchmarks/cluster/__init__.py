"""The emulated cluster: workers and summation servers as network namespaces behind shaped links.

`python -m benchmarks.cluster --quick` builds the cluster (root only), calibrates a link, measures gloo
all_reduce and torch_bps push/pull per number of server hosts k next to the paper's section 4.1 theory,
and DDP samples/s with gloo vs the "byteps" backend. See `cli.py` for the options, `topology.py` for the
network, `byteps.py` for the pluggable torch_bps runner.

Importing this package is cheap (no torch): the worker programs under `workers/` share it. Those run inside the
emulated hosts (`python -m benchmarks.cluster.workers.<name>`), print their measurement as one `RESULT {json}` line
on stdout and exit 0, or exit non-zero with the reason on stderr; they import nothing from the orchestrator but
`benchmarks.cluster.cpu`. This module holds the errors every module of the package raises.
"""


class ClusterError(Exception):
    """Base of every error raised by benchmarks.cluster."""


class NamespaceError(ClusterError):
    """An `ip`/`tc` command failed: the message names the command and quotes its stderr."""


class MeasurementError(ClusterError):
    """A process of a measurement exited non-zero or printed no result: names the process and host."""


class MeasurementTimeout(MeasurementError):
    """A measurement did not finish within its time budget; its processes were killed."""


class BackendUnavailable(ClusterError):
    """A backend (torch_bps client, the "byteps" process group) cannot be used here: the message says why."""
