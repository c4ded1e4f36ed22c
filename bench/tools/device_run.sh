#!/usr/bin/env bash
# The headline GPU figures on the offline benchmark machine (no network, bare at each start), from the checkout:
#   bash bench/tools/device_run.sh [kvtide bench gpu options]     e.g. --dry-run, --quick, --steps real-kv,zip-engine
# Installs the wheels carried in ./.whl (FlashInfer and what the machine lacks; no index), puts them and the checkout
# on PYTHONPATH, then runs `kvtide bench gpu`, which rebuilds the carried real-KV capture from its planes
# (bench/data/real_kv.{hdr,lo.xz,hi.xz}). Into $OUT go the result JSONs, gpu_summary.json and one archive of the
# whole run folder (logs, PNGs): what comes back from that machine is a few files. Do not pass --out-dir.
# What to carry and why: docs/benchmarks.md, "Reproducing the GPU figures".
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/kvtide-gpu-out}
run=/tmp/kvtide-gpu
rm -rf "$run"
mkdir -p "$out" "$run"
python3 -m kvtide.cli bench gpu --out-dir "$run" "$@"
rc=$?
cp "$run"/*.json "$out"/ 2> /dev/null
if [ -n "$(ls -A "$run")" ]; then
  tar -czf "$out/gpu_run.tar.gz" -C "$(dirname "$run")" "$(basename "$run")"
fi
exit $rc
