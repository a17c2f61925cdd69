"""``python -m cluster.compare``: the ``gspo-compare`` command (``cluster.compare.runs.main``)."""

import sys

from cluster.compare.runs import main

sys.exit(main())
