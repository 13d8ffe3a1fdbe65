"""``python -m grpolab`` (also what ``torchrun -m grpolab`` runs)."""

import sys

from .cli import main

sys.exit(main())
