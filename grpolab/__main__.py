"""``python -m grpolab`` (also what ``torchrun -m grpolab`` runs)."""

import sys

from grpolab.app import main

sys.exit(main())
