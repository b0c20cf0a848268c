"""``python -m trio_vllm.reference_engine``: run one reference engine core process."""

from __future__ import annotations

import sys


def main() -> int:
    from ._options import parse_options

    options = parse_options()
    from ._server import run_engine

    return run_engine(options)


if __name__ == "__main__":
    sys.exit(main())
