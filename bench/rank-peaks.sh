# Sourced by the bench scripts that measure `qcal run`: peak resident memory per worker rank.
#
# rank_peaks_start DONE_FILE OUT_FILE: samples VmHWM (kB) of every qcal-worker process every
#   0.2 s until DONE_FILE exists, then writes "pid peak_kB" lines to OUT_FILE (background; the
#   pid of the sampler is in RANK_PEAKS_PID).
# rank_peaks_report RUN_LOG PEAKS_FILE: the peaks of this run's own ranks (their pids from the
#   run's "rank r registered: ..., pid N" lines; other qcal-worker processes on the machine are
#   sampled too but not reported), ascending, in GiB: "6.81 / 7.01".
_rank_peaks_sample() {
  declare -A peak
  while [ ! -f "$1" ]; do
    for p in $(pgrep -x qcal-worker || true); do
      v=$(awk '/VmHWM/{print $2}' "/proc/$p/status" 2>/dev/null || true)
      if [ -n "$v" ] && { [ -z "${peak[$p]:-}" ] || [ "$v" -gt "${peak[$p]}" ]; }; then peak[$p]=$v; fi
    done
    sleep 0.2
  done
  for p in "${!peak[@]}"; do echo "$p ${peak[$p]}"; done
}
rank_peaks_start() {
  _rank_peaks_sample "$1" > "$2" &
  RANK_PEAKS_PID=$!
}
rank_peaks_report() {
  local ranks
  ranks=$(sed -n 's/.* registered: .*, pid \([0-9]*\) .*/\1/p' "$1" | sort -u)
  for p in $ranks; do grep "^$p " "$2" || true; done | sort -k2 -n |
    awk '{printf "%s%.2f", (NR>1?" / ":""), $2/1048576}'
}
