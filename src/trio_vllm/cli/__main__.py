"""``python -m trio_vllm.cli``: the ``trio-vllm`` command."""

import sys

from . import main

sys.exit(main())
