#!/usr/bin/env bash
# The GPU check of issue 19 (docs/gpu.md): on a CUDA machine with the project's requirements already
# installed (no network, nothing installed here) run the CUDA suite (tests/gpu) and the single-GPU
# benchmark (benchmarks/gpu_single.py), and write a summary.
#
#   tools/gpu_check.sh [--suite | --benchmark | --all] [OUTPUT_DIR]
#   tools/gpu_check.sh --quick OUTPUT_DIR     # issue 36: about 6 minutes on one H100
#
# --quick: the CUDA tests of issue 36 (tests/gpu/test_host_sync_cuda.py: a step under
# torch.cuda.set_sync_debug_mode("error"), per-layer CUDA graphs; $QUICK_TESTS overrides the list),
# then the benchmark at Llama-3.2 3B, seq 4096, with every row (plain torch eager and compiled,
# ours eager and compiled, ours FP8) and a profile of "ours compiled", then Llama-3.2 1B at 2048 and
# GPT-2 1.5B at 1024 eager only; writes quick-tests.log, quick-tests.xml, bench-3b.json,
# bench-3b.profile.md, bench-others.json, benchmark-quick.log and summary.md. No network, nothing
# installed; each phase has its own timeout ($QUICK_TEST_TIMEOUT 100 s, $QUICK_BENCH_TIMEOUT 270 s,
# $QUICK_OTHERS_TIMEOUT 100 s).
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
    --quick) PHASES="quick"; shift ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "error: unknown option $1 (use --suite, --benchmark, --all or --quick)" >&2; exit 2 ;;
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

if [[ "$PHASES" == "quick" ]]; then
    rm -f "$GPU_FIGURES"
    echo "== quick: CUDA tests of issue 36 -> $DEST/quick-tests.log"
    # shellcheck disable=SC2086  # QUICK_TESTS is a list of pytest paths
    timeout "${QUICK_TEST_TIMEOUT:-100}" "$PY" -m pytest ${QUICK_TESTS:-tests/gpu/test_host_sync_cuda.py} \
        -m cuda -p no:cacheprovider -rA --junitxml="$DEST/quick-tests.xml" > "$DEST/quick-tests.log" 2>&1
    tests_rc=$?
    tail -n 5 "$DEST/quick-tests.log"
    echo "== quick: benchmark llama3.2-3B@4096, every row -> $DEST/benchmark-quick.log"
    timeout "${QUICK_BENCH_TIMEOUT:-270}" "$PY" benchmarks/gpu_single.py --configs llama3.2-3B@4096 \
        --steps 6 --warmup 3 --profile "ours compiled" --out "$DEST/bench-3b.json" \
        > "$DEST/benchmark-quick.log" 2>&1
    bench_rc=$?
    echo "== quick: benchmark llama3.2-1B@2048 and gpt2-1.5B@1024, eager rows" >> "$DEST/benchmark-quick.log"
    timeout "${QUICK_OTHERS_TIMEOUT:-100}" "$PY" benchmarks/gpu_single.py --configs llama3.2-1B@2048 \
        gpt2-1.5B@1024 --no-compile --no-fp8 --steps 5 --warmup 2 --out "$DEST/bench-others.json" \
        >> "$DEST/benchmark-quick.log" 2>&1
    others_rc=$?
    tail -n 30 "$DEST/benchmark-quick.log"
    "$PY" - "$DEST" "$tests_rc" "$bench_rc" "$others_rc" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.gpu_single import markdown, title

dest, tests_rc, bench_rc, others_rc = Path(sys.argv[1]), *sys.argv[2:]
lines = ["# GPU check (quick, issue 36)", "", "```", (dest / "environment.txt").read_text().strip(),
         "```", "", f"## CUDA tests (exit status {tests_rc})", ""]
xml = dest / "quick-tests.xml"
if xml.exists():
    lines += ["| test | result | seconds |", "| --- | --- | ---: |"]
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        lines.append(f"| {case.get('name')} | {outcome} | {float(case.get('time', 0)):.1f} |")
else:
    lines.append("No JUnit report (see quick-tests.log).")
for name, rc in (("bench-3b.json", bench_rc), ("bench-others.json", others_rc)):
    lines += ["", f"## Benchmark {name} (exit status {rc})", ""]
    path = dest / name
    if not path.exists():
        lines.append("No result (see benchmark-quick.log).")
        continue
    data = json.loads(path.read_text())
    for run in data["runs"]:
        lines += [f"### {title(run)}", "", markdown(run), ""]
        if "compiled_vs_torch_compiled" in run:
            lines.append(f"ours compiled / torch.compile: {run['compiled_vs_torch_compiled']:.3f}x "
                         f"(issue 36 target >= 1.1x)")
    if data.get("out_of_memory"):
        lines.append(f"out of memory: {', '.join(data['out_of_memory'])}")
profile = dest / "bench-3b.profile.md"
if profile.exists():
    lines += ["", profile.read_text()]
(dest / "summary.md").write_text("\n".join(lines) + "\n")
print(f"summary: {dest / 'summary.md'}")
EOF
    [ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$others_rc" -eq 0 ] && exit 0
    exit 1
fi

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
