"""`python -m torch_bps.doctor`: why is (or isn't) this job faster? See __main__.py.

It measures a job through a Runtime of its own and predicts with the paper's rule (engine/placement.py).

May import: torch, torch_bps.config, local, runtime, wire, engine.placement.
"""
