"""Fault tests with real processes: killed and stalled ranks and servers, failover, garbage on the wire."""
