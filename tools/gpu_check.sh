#!/usr/bin/env bash
# The GPU check of issue 19 (docs/gpu.md): on a CUDA machine with the project's requirements already
# installed (no network, nothing installed here) run the CUDA suite (tests/gpu) and the single-GPU
# benchmark (benchmarks/gpu_single.py), and write a summary.
#
#   tools/gpu_check.sh [--suite | --benchmark | --all] [OUTPUT_DIR]
#
# OUTPUT_DIR defaults to $OUT when set, else ./gpu-check. Interpreter: $PYTHON, else python3 on PATH.
# $BENCH_ARGS adds flags to the benchmark (e.g. "--size gpt-1.3B --no-compile"); $SUITE_ARGS to
# pytest (e.g. "-k overlap"). $SUITE_TIMEOUT / $BENCH_TIMEOUT bound each phase (seconds, default
# 540 each, so that one phase fits a 10-minute slot).
# Writes: summary.md (environment, suite results, measured figures, benchmark table), gpu-suite.log,
# gpu-suite.xml, figures.jsonl, benchmark.log, gpu_single.json. Exit status: 0 when every phase run
# passed, 1 when one failed, 2 when there is no CUDA device.
set -uo pipefail

cd "$(dirname "$0")/.."
PHASES="suite benchmark"
case "${1:-}" in
    --suite) PHASES="suite"; shift ;;
    --benchmark) PHASES="benchmark"; shift ;;
    --all) shift ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "error: unknown option $1 (use --suite, --benchmark or --all)" >&2; exit 2 ;;
esac
DEST="${1:-${OUT:-gpu-check}}"
PY="${PYTHON:-python3}"
mkdir -p "$DEST" || { echo "error: cannot create output directory $DEST" >&2; exit 2; }
DEST="$(cd "$DEST" && pwd)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export GPU_FIGURES="$DEST/figures.jsonl"

if ! "$PY" - > "$DEST/environment.txt" 2>&1 <<'EOF'
import sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA runtime {torch.version.cuda}")
if not torch.cuda.is_available():
    print("CUDA is not available")
    sys.exit(1)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}")
print(f"NCCL available: {torch.distributed.is_nccl_available()}, "
      f"gloo available: {torch.distributed.is_gloo_available()}")
EOF
then
    cat "$DEST/environment.txt" >&2
    echo "error: no CUDA device here (see $DEST/environment.txt); run this on a GPU machine" >&2
    printf '# GPU check\n\nNot run: CUDA is not available.\n' > "$DEST/summary.md"
    exit 2
fi
cat "$DEST/environment.txt"

status=0
suite_rc="not run"
bench_rc="not run"
if [[ " $PHASES " == *" suite "* ]]; then
    rm -f "$GPU_FIGURES"
    echo "== CUDA suite (tests/gpu) -> $DEST/gpu-suite.log"
    # shellcheck disable=SC2086  # SUITE_ARGS is a list of pytest words
    timeout "${SUITE_TIMEOUT:-540}" "$PY" -m pytest tests/gpu -m cuda -p no:cacheprovider -rA \
        --durations=15 --junitxml="$DEST/gpu-suite.xml" ${SUITE_ARGS:-} > "$DEST/gpu-suite.log" 2>&1
    suite_rc=$?
    tail -n 5 "$DEST/gpu-suite.log"
    [ "$suite_rc" -eq 0 ] || status=1
fi
if [[ " $PHASES " == *" benchmark "* ]]; then
    echo "== benchmark (benchmarks/gpu_single.py) -> $DEST/benchmark.log"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
    timeout "${BENCH_TIMEOUT:-540}" "$PY" benchmarks/gpu_single.py --out "$DEST/gpu_single.json" \
        ${BENCH_ARGS:-} > "$DEST/benchmark.log" 2>&1
    bench_rc=$?
    tail -n 12 "$DEST/benchmark.log"
    [ "$bench_rc" -eq 0 ] || status=1
fi

"$PY" - "$DEST" "$suite_rc" "$bench_rc" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

dest, suite_rc, bench_rc = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
lines = ["# GPU check", "", "## Environment", "", "```", (dest / "environment.txt").read_text().strip(),
         "```", "", f"## CUDA suite (exit status {suite_rc})", ""]
xml = dest / "gpu-suite.xml"
if suite_rc != "not run" and xml.exists():
    cases = list(ET.parse(xml).getroot().iter("testcase"))
    lines += ["| test | result | seconds |", "| --- | --- | ---: |"]
    for case in cases:
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")),
                       "passed")
        reason = next((child.get("message", "") for child in case if child.tag == "skipped"), "")
        label = outcome + (f": {reason[:120]}" if reason else "")
        lines.append(f"| {case.get('classname')}::{case.get('name')} | {label} | "
                     f"{float(case.get('time', 0)):.1f} |")
elif suite_rc != "not run":
    lines.append("No JUnit report (see gpu-suite.log).")
figures = dest / "figures.jsonl"
if figures.exists():
    lines += ["", "## Measured figures", "", "```"]
    lines += figures.read_text().strip().splitlines()
    lines += ["```"]
lines += ["", f"## Benchmark (exit status {bench_rc})", ""]
result = dest / "gpu_single.json"
if bench_rc == "0" and result.exists():
    from benchmarks.gpu_single import markdown
    data = json.loads(result.read_text())
    lines += [f"{data['size']} on {data['device']}, micro-batch {data['micro_batch']}, seq "
              f"{data['config']['seq_length']}, recompute {data['recompute']}, peak "
              f"{data['peak_tflops']} TFLOP/s (bf16 dense)", "", markdown(data), "",
              f"ours / plain torch: {data['ours_vs_torch']:.3f}x (target >= 0.95x: "
              f"{'met' if data['target_met'] else 'NOT met'})"]
elif bench_rc != "not run":
    lines.append("The benchmark failed; see benchmark.log.")
(dest / "summary.md").write_text("\n".join(lines) + "\n")
print(f"summary: {dest / 'summary.md'}")
EOF
exit "$status"
