#!/usr/bin/env bash
# JaxBackend on a lent GPU (an H200), in one call of under 9 minutes:
#   0. `kipp doctor` on the tiny checkpoint (devices, every kernel probe and the first step on
#      the kernels, gates, a speed check; JSON in $OUT/doctor.json), with kernel fallback on so
#      it reports each kernel that falls back; every later stage runs with fallback off
#      (KIPP_KERNEL_FALLBACK=0), so a failing kernel fails its stage instead of timing a twin;
#   1. the Pallas kernel tests compiled (no interpret mode),
#   2. the whole-model gates vs the reference backend (kernels; then the twins, KIPP_JAX_TWINS=1),
#   3. a decode/prefill benchmark at the Qwen3-0.6B shape (synthetic weights, BF16 and q8_0),
# and a short table last. It installs nothing: it runs this tree with the machine's python3
# (JAX 0.11 with CUDA, numpy, ml_dtypes, safetensors, transformers, pytest are in its image).
#
#   bash bench/device_check.sh            # from the repository root, on the GPU machine
#
# The last table sets the measured kernel path against the H200 compile report's predicted tok/s
# (`python -m bench kernels`, bench/README.md). Every stage has its own time limit, so one that hangs or fails still leaves the others and
# the table. Logs and JSON rows go to $OUT (the device tool's folder) or /tmp/kipp-device-check.
# Targets: decode >= 60% of the HBM roofline single-stream (BF16), and batched
# aggregate decode >= 6x from 1 to 8 sequences.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KIPP_HOME="${KIPP_HOME:-/tmp/kipp-home}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # leave room for the reference's numpy side
LOGS="${OUT:-/tmp/kipp-device-check}"
PY="${PYTHON:-python3}"
CHECKPOINT=kipp-synthetic/qwen3-0.6b-shape
mkdir -p "$LOGS" "$KIPP_HOME"
rm -f "$LOGS/bench.jsonl"
START=$(date +%s)
. bench/stages.sh

# Limits add up to 545 s: run with the device tool's timeout_s of about 600.
stage env 20 bash -c "nvidia-smi -L; $PY -c 'import jax; print(jax.__version__, jax.devices())' &&
  $PY -c 'from bench.fallback import gpu_present; assert gpu_present(), \"gpu_present() is False\"'"

stage doctor 75 "$PY" -m kipp.cli doctor --backend jax --json "$LOGS/doctor.json"
export KIPP_KERNEL_FALLBACK=0

stage kernel-tests 80 env KIPP_PALLAS_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_jax_kernels.py

stage gates-kernels 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_jax_backend.py \
  -k "matches_reference or scrambled or batched or recompile or selection"

stage gates-twins 30 env KIPP_JAX_TWINS=1 "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_jax_backend.py -k "test_jax_matches_reference and (bf16 or q8_0)"

artifact() {  # the artifact path of $CHECKPOINT in scheme $1
  "$PY" -c "from kipp.formats.store import artifact_path as p; print(p('$CHECKPOINT', '$1'))"
}
BENCH=(-m kipp.cuda.bench --prompt 256 --decode 48 --kv-tokens 8192 --json "$LOGS/bench.jsonl")

stage prepare-bf16 60 "$PY" -m kipp.cli prepare "$CHECKPOINT" --scheme bf16
stage bench-bf16 80 "$PY" "${BENCH[@]}" "$(artifact bf16)" --batch 1,8
stage prepare-q8_0 40 "$PY" -m kipp.cli prepare "$CHECKPOINT" --scheme q8_0
stage bench-q8_0 40 "$PY" "${BENCH[@]}" "$(artifact q8_0)" --batch 1
stage bench-bf16-twins 30 env KIPP_JAX_TWINS=1 "$PY" "${BENCH[@]}" "$(artifact bf16)" --batch 1

echo
echo "== kipp doctor"; doctor_summary
echo
summary_table
"$PY" - "$LOGS/bench.jsonl" <<'EOF'
import json, os, sys
rows = [json.loads(line) for line in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
print(f"\n{'scheme':8} {'path':24} {'batch':>5} {'prefill tok/s':>13} {'decode tok/s':>12} "
      f"{'step ms':>8} {'roof ms':>8} {'% roof':>6} {'GB/s':>6}")
single = {}
for r in rows:
    path = r["backend"].split("(", 1)[1].split(" on ")[0]
    roof_ms = r.get("roofline_ms", float("nan"))
    print(f"{r['scheme']:8} {path[:24]:24} {r['batch']:5d} {r['prefill_tok_s']:13.0f} "
          f"{r['decode_tok_s']:12.1f} {r['decode_step_ms']:8.3f} {roof_ms:8.3f} "
          f"{100 * roof_ms / r['decode_step_ms']:6.1f} {r['bandwidth_gb_s']:6.0f}")
    key = (r["scheme"], path)
    if r["batch"] == 1:
        single[key] = r["decode_tok_s"]
    elif key in single:
        scaling = r["decode_tok_s"] / single[key]
        print(f"{'':8} {'batched scaling':24} {r['batch']:5d} x{scaling:.2f} aggregate vs 1 "
              f"sequence (target >= 6x at 8)")
print("targets: decode >= 60% of roofline single-stream (BF16); batched >= 6x from 1 to 8")

# Measured vs the compile report's prediction (bench/kernels.py: kernel roofline times summed
# over a step; decode at 2,048 positions, prefill of a 512-token chunk, so an upper bound).
from bench.kernels import latest
record = latest()
if record is None:
    print("\nno kernels record in bench/results: run `python -m bench kernels` first")
    raise SystemExit(0)
predicted = {(p["checkpoint"], p["scheme"]): p for p in record["predicted"]}
print(f"\n{'scheme':8} {'batch':>5} {'decode meas':>11} {'decode pred':>11} {'%':>5} "
      f"{'prefill meas':>12} {'prefill pred':>12} {'%':>5}   (0.6B, record {record['created']})")
for r in rows:
    p = predicted.get(("0.6B", r["scheme"]))
    if p is None or r["batch"] != 1 or "Triton" not in r["backend"]:
        continue
    d, f = p["decode_tok_s"], p["prefill_tok_s"]
    print(f"{r['scheme']:8} {r['batch']:5d} {r['decode_tok_s']:11.1f} {d:11.1f} "
          f"{100 * r['decode_tok_s'] / d:5.1f} {r['prefill_tok_s']:12.0f} {f:12.0f} "
          f"{100 * r['prefill_tok_s'] / f:5.1f}")
EOF
