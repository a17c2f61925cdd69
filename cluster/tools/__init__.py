"""Commands beside training: ``gpu_smoke`` (``make gpu-smoke``, the GPU path end to end) and
``config_reference`` (``python -m cluster.tools.config_reference > docs/config.md``)."""
