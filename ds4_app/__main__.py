"""``python -m ds4_app`` runs the ``ds4-app`` command."""

import sys

from .cli import main

sys.exit(main())
