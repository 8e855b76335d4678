"""fasttrans benchmarks: one script per op plus the end-to-end model (see README.md)."""
