"""The resource plan of a run from its config alone (``--dry-run``): placement per node and memory per GPU and
host (``plan``), from the per-token and per-rank byte counts of ``memory_model``. Torch-free."""
