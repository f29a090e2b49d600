"""`python -m torch_bps.doctor`: why is (or isn't) this job faster? See __main__.py.

May import: nothing.
"""
