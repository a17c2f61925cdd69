"""The wiring: the only package that knows Ray placement and the driver loop.

At the top, the front door and the config: ``train`` (``gspo-train``), ``config`` (the run config composed from
the services' sections) and ``common`` (the repository root, a free port, a mean). The rest lives in rooms:

- ``submit``: the run as a Ray job (``gspo-submit``, ``python -m cluster.submit``) and a user's folder shipped
  with it.
- ``compare``: equal-budget comparisons (``gspo-compare``, ``python -m cluster.compare``): the runs, their report
  and what differs beyond the spread.

- ``driver``: the run itself (``Trainer``: collect, score, prepare, train, sync, log) and its parts: rollout
  collection, batching, checkpoints, resume, evaluation, the health guard's policy, scaling, metrics.
- ``runtime``: Ray: actors in placement groups and on nodes, the learner's ranks as one group, the weight sync,
  a private local head or multi-node cluster, user code shipped to workers, and what the terminal shows.
- ``data``: prompts: the generated tasks, your own files and GSM8K, chat templates.
- ``models``: the tiny models built locally (``builtin:tiny_*``), GGUF import, the packaged chat model, hub ids
  and ``model.path`` resolution.
- ``planning``: the resource plan (``--dry-run``) and the memory model behind it; torch-free.
- ``tools``: commands beside training: the GPU smoke run and the config reference generator.
"""
