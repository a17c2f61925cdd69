"""The equal-budget comparison (``gspo-compare``, ``python -m cluster.compare``): ``runs`` the arms and their
runs (one config trained per algorithm or arm and seed, the warm start shared within a seed); ``report`` each
run's figures, their mean and spread over seeds, ``report.md`` and ``curves.png``; ``spread`` what differs
beyond the spread.
"""
