"""Benchmarks: `python -m rlloop.bench NAME`. Each compares systems side by side and ends with one JSON line."""
