"""`python -m undercurrent_client` is the `undercurrent` command."""

import sys

from undercurrent_client.cli import main

sys.exit(main())
