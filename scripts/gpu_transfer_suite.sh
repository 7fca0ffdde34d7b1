#!/usr/bin/env bash
# The GPU half of BENCHMARKS.md's transfer section, in one device call (nvidia-h200-x2):
# which allocations XLA donates in place and UCX can share (probe), then the transfer benchmark
# for scattered / contiguous requests, 0 or 4 UCX threads, across and within GPUs.
# Full logs go to $LOGS (packed into $OUT/transfer_logs.tgz when $OUT is set); tables to stdout.
# Needs the nixl-cu13 wheel unpacked at $NIXL_DIR (default /tmp/nixl) or on PYTHONPATH.
set -u
NIXL_DIR=${NIXL_DIR:-/tmp/nixl}
LOGS=${LOGS:-/tmp/bench_logs}
mkdir -p "$LOGS"
if [ -f .nixl/nixl_cu13.tar.xz ] && [ ! -d "$NIXL_DIR" ]; then
  mkdir -p "$NIXL_DIR" && tar -xJf .nixl/nixl_cu13.tar.xz -C "$NIXL_DIR"
fi
export PYTHONPATH=$NIXL_DIR:$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
n=0
bench() {  # bench ENV... -- ARGS...
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  n=$((n + 1))
  local log="$LOGS/bench_$n.txt"
  echo "=== ${envs[*]} $*"
  env "${envs[@]}" UCX_PROTO_INFO=y timeout 240 python scripts/bench_transfer.py "$@" \
    >"$log" 2>&1
  grep -E "^(one request|path|connector|raw|device copy|peer copy|descriptors|control)" "$log"
  echo "UCX transports in the log: $(grep -oE 'cuda_ipc/[a-z0-9_]+|tcp/lo|cma/memory' "$log" \
    | sort | uniq -c | tr '\n' ' ')"
}
echo "### probe"
python scripts/probe_gpu_regions.py >"$LOGS/probe.txt" 2>&1
grep '^{' "$LOGS/probe.txt" || tail -5 "$LOGS/probe.txt"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
for variant in "" "--contiguous" "--request-pages 64" "--request-pages 64 --contiguous" \
  "--request-pages 64 --contiguous --threads 4"; do
  bench BENCH_ALLOC=torch -- --gpu 0 1 $variant
done
for variant in "--contiguous" "--request-pages 64 --contiguous"; do
  bench BENCH_ALLOC=torch -- --gpu 0 0 $variant
done
fi
echo "### engines: P/D on GPU 0 (scripts/check_gpu_pd.py)"
for precision in "" "--highest"; do
  UCX_PROTO_INFO=y timeout 400 python scripts/check_gpu_pd.py $precision >>"$LOGS/pd.txt" 2>&1
done
grep -E "^(pull|push|colocated)|Error|error" "$LOGS/pd.txt" | head -20
echo "UCX transports in the log: $(grep -oE 'cuda_ipc/[a-z0-9_]+|cuda_copy/[a-z0-9_]+|tcp/lo|cma/memory' \
  "$LOGS/pd.txt" | sort | uniq -c | tr '\n' ' ')"
if [ -n "${OUT:-}" ]; then tar -czf "$OUT/transfer_logs.tgz" -C "$LOGS" .; fi
