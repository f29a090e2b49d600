"""Programs that run inside the emulated hosts (`python -m benchmarks.cluster.workers.<name>`).

Each prints its measurement as one `RESULT {json}` line on stdout and exits 0, or exits non-zero with
the reason on stderr. They import nothing from the orchestrator but `benchmarks.cluster.cpu`.
"""
