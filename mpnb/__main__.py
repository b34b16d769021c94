"""``python -m mpnb`` runs the ``mpnb`` command."""

import sys

from mpnb.cli import main

sys.exit(main())
