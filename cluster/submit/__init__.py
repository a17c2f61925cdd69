"""Training submitted as a Ray job (``gspo-submit``, ``python -m cluster.submit``): ``job`` the job (its
runtime env, entry point and paths, the Jobs API calls, the command); ``folder`` what a user's own folder
ships with it and the checks before it travels.
"""
