"""``python -m cluster.submit``: the ``gspo-submit`` command (``cluster.submit.job.main``)."""

import sys

from cluster.submit.job import main

sys.exit(main())
