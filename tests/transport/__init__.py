"""Tests of the transport: the wire header, packed alike by torch_bps/wire.py and cpp_ext/transport/wire.h."""
