"""`python -m rlloop.bench NAME [args]` runs `rlloop.bench.NAME.main(args)`."""

import importlib
import sys

# The benchmarks; the package's other modules are their helpers (engine and vLLM worker processes, TRL's runner).
BENCHES = ("device", "e2e", "logprob_memory", "loop", "peaks", "resources", "rollout", "sync")


def main() -> None:
    usage = f"usage: python -m rlloop.bench {{{'|'.join(BENCHES)}}} [args]   (NAME --help: its arguments)"
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(usage)
        for name in BENCHES:
            doc = importlib.import_module(f"rlloop.bench.{name}").__doc__ or ""
            print(f"  {name:15s} {' '.join(doc.split(chr(10) * 2)[0].split())}")  # the docstring's first paragraph
        return
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHES:
        print(usage, file=sys.stderr)
        sys.exit(2)
    importlib.import_module(f"rlloop.bench.{sys.argv[1]}").main(sys.argv[2:])


if __name__ == "__main__":
    main()
