#!/usr/bin/env bash
# The branch exp/dp4a's experiment in one device call (~8 min): the one-token GEMVs' and the MoE gate+up's dot products
# on dp4a with x in 16-bit fixed point (switches qmv_dp4a, moe_dp4a; csrc/backend/cuda/x16.cuh). Build the cp312
# wheel from the branch into .whl/ first (benchmarks/NOTES.md, session 32), then (device tool, carry [".whl"]):
#   bash benchmarks/probes/exp_dp4a.sh            # op cases of qmm, rms_norm_qmm and moe (every switch on / all off),
#                                                 # then ab_decode.py for both switches at 4K
#   AB_L=4096,32768 bash benchmarks/probes/exp_dp4a.sh   # the 32K point too (~11 min: two calls, STEP=ab the second)
set -u
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/lily-*-cp312-*.whl > /tmp/install.log 2>&1 \
  || { tail /tmp/install.log; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t=$(date +%s)
if [ "${STEP:-all}" != ab ]; then
  timeout 240 python3 -m pytest tests/ops -q -x -k "qmm or moe" -p no:cacheprovider 2>&1 | tail -4
  echo "== ops $(( $(date +%s) - t )) s"; t=$(date +%s)
fi
timeout ${AB_T:-330} python3 benchmarks/probes/ab_decode.py qmv_dp4a moe_dp4a --lengths ${AB_L:-4096} \
  --runs ${AB_R:-4} 2>&1 | tail -8
echo "== ab $(( $(date +%s) - t )) s"
