"""Tests of triton_kernels: each kernel against its torch reference, and ahead-of-time compilation."""
