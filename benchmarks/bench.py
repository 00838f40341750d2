#!/usr/bin/env python
"""Inference benchmark of fastbert against Hugging Face BERT-family encoders, on real tokens.

    python benchmarks/bench.py --quick --out benchmarks/results/cpu-2core-DATE/   # the CPU subset, a few minutes
    python benchmarks/bench.py --device cuda --out benchmarks/results/h100-DATE/   # the full sweep on a GPU
    python benchmarks/bench.py --help

One process times every provider on the same inputs, round-robin (one run of each provider per repetition, the
order rotated every repetition), so the ratios between providers are comparable. Before a case is timed, every
provider's ``last_hidden_state`` is checked against hf-sdpa on the real tokens; a mismatch raises ``OutputMismatch``
and the run exits non-zero without writing results (``--keep-going``: recorded, and the run goes on).

The harness is the package ``benchmarks/fastbench`` (see its ``__init__``); this file is its entry point.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fastbench import *  # noqa: E402,F401,F403  (importers of this file see the harness's names)
from fastbench.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
