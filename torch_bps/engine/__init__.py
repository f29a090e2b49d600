"""The worker-side engine: partitioning, placement, and the stages of one collective.

Front doors (the "byteps" ProcessGroup, bps_hook) call `PushPullEngine.run` (pipeline.py), which composes the
stages, each in a file of its own: the local stages among the machine's ranks (local_stages.py), the network
stage through the C++ client it is handed, the stall check (stall.py) and the wire transform (wire_transform.py:
wire casts, precision.py; codecs, compress.py). Keys and cuts are partition.py's, servers placement.py's, what each
rank pushes and pulls exchange.py's; op.py is one collective on its way. The engine is handed its client and
local channels: it imports neither.

May import: torch, torch_bps.config, torch_bps.errors, torch_bps.futures, torch_bps.wire.
"""
