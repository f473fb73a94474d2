#!/usr/bin/env bash
# One batched H200 session: GPU tests, relay host cost (every wire), the interpreter alone
# (fresh and persistent inputs), the floors of single calls (relay_floor), the pure calls
# of a step on the host (pure_breakdown), DP agreement and overlap on the host CPU,
# memory flatness, and an NCCL `purepp run` + `purepp check`.
# Run from the repository root; results go to $OUT (default gpu-results/, made if missing).
set -uo pipefail
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:."
nvidia-smi -L
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
timeout 330 python3 -m benchmarks.relay_host_cost --device cuda --steps 300 --rounds 3 --warmup 42 \
    --wire seed packed fixed --json "$OUT/relay_cuda.json" > "$OUT/relay_cuda.md" 2>&1
grep -A80 "host us/step" "$OUT/relay_cuda.md" | head -60
for inputs in "" --persistent-inputs; do
    timeout 120 python3 -m benchmarks.interpreter_modes --device cuda --steps 600 --rounds 3 $inputs 2>&1 |
        tee -a "$OUT/interpreter_modes.md" | tail -13
done
timeout 60 python3 -m benchmarks.relay_floor --device cuda --calls 500 --rounds 3 2>&1 | tee "$OUT/relay_floor.md" | tail -22
timeout 120 python3 -m benchmarks.pure_breakdown --calls 5000 --rounds 3 2>&1 | tee "$OUT/pure_breakdown.md" | grep -E "step \(|seed_noop"
timeout 120 python3 -m benchmarks.dp_agreement --rounds 7 --iters 1000 2>&1 | tee "$OUT/dp_agreement.txt" | tail -12
timeout 120 python3 -m benchmarks.dp_agreement --rounds 7 --iters 1000 --no-collective 2>&1 | tee "$OUT/dp_agreement_pure.txt" | tail -12
timeout 150 python3 benchmarks/dp_overlap.py --steps 300 --forward spin 2>&1 | tee "$OUT/dp_overlap.txt" | tail -12
timeout 90 python3 -m benchmarks.relay_memory --device cuda --mode captured --steps 5000 2>&1 | tee "$OUT/relay_memory.txt" | tail -6
log="$(mktemp -d)"
timeout 120 python3 -m purepp.runner.cli run --backend nccl --pp 1 --dp 1 --spec 3 --wire packed \
    --validate-header --log-dir "$log/logs" 2>&1 | tail -6 | tee "$OUT/nccl_run.txt"
timeout 60 python3 -m purepp.runner.cli check "$log/logs" 2>&1 | tee -a "$OUT/nccl_run.txt"
