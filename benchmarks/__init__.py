"""Benchmarks of torch_bps. Each benchmark is a script or package with `main(argv)`, `--json` and ratios."""
