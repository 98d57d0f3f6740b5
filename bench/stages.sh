# Sourced by bench/device_check.sh and bench/mac_check.sh: stages that each run under a time
# limit with their own log, so one that fails or hangs still leaves the others, and the table
# of their results. The caller sets LOGS (the log folder) and START (date +%s).
RESULTS=()

limit() {  # limit SECONDS command...: coreutils' timeout, or perl's alarm where it is missing
  local seconds=$1
  shift
  if command -v timeout >/dev/null 2>&1; then
    timeout --kill-after=10 "$seconds" "$@"
  else  # macOS
    perl -e 'alarm shift; exec @ARGV' "$seconds" "$@"
  fi
}

stage() {  # stage NAME SECONDS command...: run with a limit, log, record PASS/FAIL
  local name=$1 seconds=$2
  shift 2
  echo "== $name (limit ${seconds}s, t=$(( $(date +%s) - START ))s)"
  local began
  began=$(date +%s)
  limit "$seconds" "$@" 2>&1 | tee "$LOGS/$name.log"
  local code=$?
  local took=$(( $(date +%s) - began ))
  if [ $code -eq 0 ]; then RESULTS+=("$name|PASS|${took}s")
  else RESULTS+=("$name|FAIL (exit $code)|${took}s"); fi
}

summary_table() {  # every stage's result and time
  echo "== summary (total $(( $(date +%s) - START ))s; logs in $LOGS)"
  printf '%-18s %-16s %s\n' stage result time
  local row name result took
  for row in "${RESULTS[@]}"; do
    IFS='|' read -r name result took <<< "$row"
    printf '%-18s %-16s %s\n' "$name" "$result" "$took"
  done
}

doctor_summary() {  # the pasteable summary of the doctor stage's report
  sed -n '/^```$/,/^```$/p' "$LOGS/doctor.log" || true
}

any_failed() {
  local row
  for row in "${RESULTS[@]}"; do
    case "$row" in *FAIL*) return 0 ;; esac
  done
  return 1
}
