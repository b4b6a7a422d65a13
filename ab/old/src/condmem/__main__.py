"""``python -m condmem`` runs the command line."""

import sys

from condmem.cli import main

sys.exit(main())
