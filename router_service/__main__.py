"""python -m router_service --port N --probes DIR: run one probe router (see cli.py)."""

import os
import sys

# One BLAS thread per scoring thread: a probe's skinny matmul gains nothing from
# more, and on shared cores more threads made it up to 20x slower. Set before
# numpy loads, in the router's own process only.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from router_service.cli import main  # noqa: E402

sys.exit(main())
