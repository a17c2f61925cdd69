"""Models built locally, with no hub: the embedded tiny Qwen3-MoE and its character tokenizer (``tiny_model``),
tiny random models of other architectures (``tiny_archs``), and ``resolve.ensure_model`` (``model.path`` ->
a model folder)."""
