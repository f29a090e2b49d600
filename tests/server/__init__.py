"""Tests of the summation server: the protocol by hand, rounds, limits, authentication, counters, streams."""
