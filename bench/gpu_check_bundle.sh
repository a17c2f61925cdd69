#!/usr/bin/env bash
# Prepare what `python -m cluster.tools.gpu_learner_check` needs on a bare GPU machine that has torch, transformers,
# accelerate, safetensors, numpy, ninja, py-cpuinfo, msgpack, einops, psutil, pyyaml (the nvidia-h200 image) but no
# DeepSpeed, pydantic or hjson, and no network: their wheels go into gpu_check_bundle/wheels (git-ignored), with
# gpu_check_bundle/run.sh, the one command to run there from the repository root:
#
#     bash gpu_check_bundle/run.sh            (carry gpu_check_bundle; the JSON line lands in $OUT when set)
#
# DeepSpeed is built here as a pure-Python wheel (`pip wheel deepspeed==0.19.8 --no-deps`, no ops prebuilt: its
# CPU Adam JIT-builds there with that machine's torch, nvcc and ninja). The others are downloaded as wheels for
# CPython 3.12 on x86-64 Linux (the GPU image's python3), at the versions this venv runs.
# Usage: bash bench/gpu_check_bundle.sh [PYTHON]   (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
OUT_DIR=gpu_check_bundle
rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR/wheels"
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
# deepspeed's sdist imports torch in setup.py: build against this venv's torch, with no op compiled.
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT_DIR/wheels" deepspeed==0.19.8
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d "$OUT_DIR/wheels" "pydantic==$(version pydantic)" "pydantic-core==$(version pydantic-core)" \
    "annotated-types==$(version annotated-types)" "typing-inspection==$(version typing-inspection)" \
    "hjson==$(version hjson)"
cat > "$OUT_DIR/run.sh" <<'RUN'
#!/usr/bin/env bash
# On the GPU machine, from the repository root: install the carried wheels beside the image's packages and run
# the learner check (about 3-6 minutes on one H200, most of it start-up and DeepSpeed's CPU Adam JIT build).
set -uo pipefail
SITE=${SITE:-/tmp/gpu_check_site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    gpu_check_bundle/wheels/*.whl || exit 3
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset DS_ACCELERATOR
OUT=${OUT:-gpu_check_bundle}
python3 -m cluster.tools.gpu_learner_check --json-out "$OUT/gpu_learner_check.json" "$@" 2>&1 | tee "$OUT/gpu_learner_check.log"
exit "${PIPESTATUS[0]}"
RUN
chmod +x "$OUT_DIR/run.sh"
du -sh "$OUT_DIR"
ls -l "$OUT_DIR/wheels"
echo "carry: $OUT_DIR   command: bash $OUT_DIR/run.sh"
