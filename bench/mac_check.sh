#!/usr/bin/env bash
# MLXBackend on Apple silicon, in one command (about 20-30 minutes on an M-series Mac):
#   0. `kipp doctor` (platform, Metal device, every kernel probe, gates, a speed check; its
#      JSON report in $LOGS/doctor.json), with kernel fallback on, so it reports every kernel
#      that falls back; every later stage runs with fallback off (KIPP_KERNEL_FALLBACK=0): a
#      kernel that fails its probe fails the stage loudly instead of measuring a twin;
#   1. the MLX test file with Metal on: its kernel tests (matvec, matmul, decode attention vs
#      the twins and numpy) and the whole-model gates on the kernels run here, skipped on Linux;
#   2. a table of every kernel vs its twin vs the numpy reference (NMSE and time);
#   3. a table of the whole model on the kernels vs the reference backend, every weight scheme,
#      BF16 and q8_0 KV;
#   4. the twins forced on Metal (KIPP_MLX_TWINS=1) through the same whole-model gates;
#   5. decode and prefill against mlx-lm on the same MLX build and the same weights (the
#      Qwen3-0.6B-shaped synthetic checkpoint; mlx-lm's own 8-bit and 4-bit group-32 conversions
#      for the quantized schemes) through the benchmark harness, which refuses to record a Kipp
#      arm whose describe() does not say it ran the Metal kernels.
# Then a summary table. Targets: decode >= 1.1x mlx-lm, prefill >= 2x.
#
#   bash bench/mac_check.sh           # from anywhere; sets up .venv-mac on first use
#
# Each stage has a time limit and its own log, so a stage that fails or hangs still leaves the
# others and the table. Logs go to $OUT or /tmp/kipp-mac-check; bench records to $LOGS/results.
set -u -o pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -s)-$(uname -m)" != "Darwin-arm64" ]; then
  echo "mac_check: needs Apple silicon (this is $(uname -s) $(uname -m))" >&2
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOGS="${OUT:-/tmp/kipp-mac-check}"
VENV="${VENV:-.venv-mac}"
CHECKPOINT=kipp-synthetic/qwen3-0.6b-shape
SCHEMES=bf16,q8_0,affine4_gs32
mkdir -p "$LOGS"
START=$(date +%s)
. bench/stages.sh

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# Kipp with MLX, pytest for the test file, mlx-lm for the peer arm (the dev extra's pinned
# torch and JAX are not needed here: the synthetic checkpoints are generated with numpy).
stage setup 900 bash -c "'$VENV/bin/pip' install --quiet --upgrade pip &&
  '$VENV/bin/pip' install --quiet -e '.[apple]' pytest mlx-lm threadpoolctl"
stage env 30 "$PY" -c "import mlx.core as mx, mlx_lm, platform
print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, platform.platform())
print('metal', mx.metal.is_available(), mx.metal.device_info() if mx.metal.is_available() else '')"

stage doctor 600 "$PY" -m kipp.cli doctor --json "$LOGS/doctor.json"
export KIPP_KERNEL_FALLBACK=0

stage tests-metal 900 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_mlx_backend.py
stage kernels 600 "$PY" -m bench.mac_check kernels
stage gates-kernels 900 "$PY" -m bench.mac_check gates
stage gates-twins 600 env KIPP_MLX_TWINS=1 "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_mlx_backend.py -k "test_mlx_matches_reference or scrambled or batched"

stage prepare 1200 "$PY" -m bench prepare --checkpoint "$CHECKPOINT" --schemes "$SCHEMES" --mlx
stage bench 1800 "$PY" -m bench run --checkpoint "$CHECKPOINT" --engines kipp --with mlx_lm \
  --backends mlx --schemes "$SCHEMES" --workloads decode,prefill512,prefill2048 \
  --runs 5 --warmup 1 --decode-tokens 128 --results "$LOGS/results"

echo
summary_table
echo
echo "kipp doctor:"; doctor_summary
echo "kernel vs twin vs reference:"; grep -E "kernel rows|FAIL" "$LOGS/kernels.log" || true
echo "whole model on the kernels:"; tail -n 17 "$LOGS/gates-kernels.log" || true
echo "Kipp (mlx, Metal kernels) vs mlx-lm, same weights, same session:"
sed -n '/^decode: /,$p' "$LOGS/bench.log" || true  # bench's summary: medians, MADs, ratios
if any_failed; then exit 1; fi
