"""`python -m rlloop.bench NAME [args]` runs `rlloop.bench.NAME.main(args)`."""

import importlib
import pkgutil
import sys

import rlloop.bench


def main() -> None:
    names = sorted(m.name for m in pkgutil.iter_modules(rlloop.bench.__path__) if not m.name.startswith("_"))
    if len(sys.argv) < 2 or sys.argv[1] not in names:
        print(f"usage: python -m rlloop.bench {{{'|'.join(names)}}} [args]", file=sys.stderr)
        sys.exit(2)
    importlib.import_module(f"rlloop.bench.{sys.argv[1]}").main(sys.argv[2:])


if __name__ == "__main__":
    main()
