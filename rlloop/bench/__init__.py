"""Benchmarks: `python -m rlloop.bench NAME`. Most compare systems side by side; each ends with one JSON line."""
