"""The resource plan of a run from its config alone (``--dry-run``, ``plan``): the actors' placement per node
(``actor_placement``) and memory per GPU and host (``memory_budget``), from the per-token and per-rank byte counts
of ``memory_model``. Torch-free."""
