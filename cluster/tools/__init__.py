"""Commands beside training: ``gpu_smoke`` (``make gpu-smoke``, the GPU path end to end), ``gpu_learner_check``
(``make gpu-learner-check``, the learner alone on a bare GPU machine) and ``config_reference``
(``python -m cluster.tools.config_reference > docs/config.md``)."""
