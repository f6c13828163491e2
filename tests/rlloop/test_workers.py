"""The worker processes' malloc setting: freed memory is reused instead of being mapped and page-faulted anew."""

import subprocess
import sys

import pytest

# 64 MiB tensors written and freed eight times, as a training step's activations are: the pages faulted in by the
# last four (16,384 pages each when they are fresh).
PROGRAM = """
import resource, sys, torch
from rlloop.workers import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
for step in range(8):
    if step == 4:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 << 20)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True).stdout
    kept, count = out.split()
    return kept, int(count)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_freed_memory_is_reused_without_page_faults():
    assert faults("default")[1] > 4 * 16_000  # glibc maps a fresh region for every one
    kept, count = faults("keep")
    assert kept == "True" and count < 16_000  # at most one of them
