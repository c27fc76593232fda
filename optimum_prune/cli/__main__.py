"""`python -m optimum_prune.cli ...` (also `torchrun -m optimum_prune.cli ...`): the `optimum-prune` console script."""

import sys

from .main import main

sys.exit(main())
