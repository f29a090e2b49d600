"""Errors of the emulated cluster: a base class, namespace set-up failures, failed or overdue measurements.

May import: the standard library only.
"""

from __future__ import annotations


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
