"""Benchmark programs (`make bench`, `make bench-peers`): not part of the installed package."""
