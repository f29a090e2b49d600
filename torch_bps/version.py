"""The version of torch_bps, in one place: setup.py reads it, `torch_bps.__version__` is it.

May import: nothing.
"""

__version__ = "0.1.0"
