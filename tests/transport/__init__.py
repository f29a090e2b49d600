"""Tests of the transport: the wire header, the C++ client over ZeroMQ and the stream transport."""
