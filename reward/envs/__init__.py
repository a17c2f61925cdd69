"""Example environments and tools (``reward.environment``), for the docs, the tests and the tiny agent configs:
``calculator.calc`` (a tool for ``env.tools``) and ``guess_number.GuessNumber`` (an ``env.cls``)."""
