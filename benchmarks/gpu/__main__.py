"""`python -m benchmarks.gpu OUTDIR ...`: the GPU suite (benchmarks/gpu/runner.py)."""

import sys

from benchmarks.gpu import runner

sys.exit(runner.main())
