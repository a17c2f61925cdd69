"""What the tests share besides fixtures: the repository root and the test processes' environment, and, in the
modules beside this one, the helpers several test modules use (test modules import helpers, never each other).

Tests run from any directory: paths into the checkout are built from ``REPO_ROOT``, never relative to the
working directory.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Set by tests/conftest.py before any test module imports torch, DeepSpeed or Ray; a value already in the
# environment wins. One thread pool of one thread per process on this 2-core machine (CONTRIBUTING.md),
# DeepSpeed's CPU accelerator, no Hugging Face hub, no usage reports.
TEST_ENV = {
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "WANDB_SILENT": "true",
}


def assert_png(path: Path, width: int, height: int, min_colours: int = 8) -> None:
    """``path`` is a PNG that decodes to ``width`` x ``height`` pixels and is not blank (at least
    ``min_colours`` distinct colours: axes, lines and text, not an empty canvas).

    Raises:
        AssertionError: it does not decode, has another size or too few colours.
    """
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG", f"{path}: {im.format}"
        assert im.size == (width, height), f"{path}: {im.size} pixels, expected {(width, height)}"
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) >= min_colours, f"{path}: {len(colours or [])} colours"
