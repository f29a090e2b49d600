"""Tests of the C++ push/pull client (cpp_ext/client, torch_bps/client.py): sums, faults, flow control, the stream
transport and the scheduler, driven through the door production uses (`Client.push_pull_batch`)."""
