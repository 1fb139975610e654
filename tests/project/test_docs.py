"""The guides in docs/ are executable: every ```bash block of docs/*.md is run or checked.

A block runs with ``bash -euo pipefail`` from the repository root, ``$WORK`` (the guides' documented
scratch-directory placeholder) set to a temporary directory and nothing else rewritten; the guides run
in the order of ``ORDER`` because later ones use the tiny dataset (docs/data.md) and checkpoint
(docs/quickstart.md) of earlier ones. A block preceded by ``<!-- not-run: reason -->`` (SLURM, several
machines, a web server, minutes of work) is only checked: every script it names exists, launch scripts
pass ``bash -n``, and -- for every block -- each ``--flag`` given to a script appears in that script's
``--help`` (flags of launch/*.sh and the sbatch script are pretrain_gpt.py's, which they forward).
A block preceded by ``<!-- slow: reason -->`` runs only in the slow suite (``pytest -m slow
tests/project/test_docs.py``, which runs every block); no fast block may depend on what a slow one makes.
The scalar names documented in docs/tensorboard.md are compared with the tags a real run wrote.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
# Dependency order: data.md makes $WORK/data, quickstart.md makes $WORK/ckpt and $WORK/runs.
ORDER = ["README.md", "data.md", "quickstart.md", "launching.md", "choosing-parallelism.md",
         "tensorboard.md", "compile.md", "tiling.md", "fp8.md", "checkpoints.md", "paper.md", "gpu.md",
         "troubleshooting.md", "design.md", "megatron-flags.md", "optimizer-precision.md",
         "optimizers.md", "muon_convergence.md", "moe.md", "zero-experts.md",
         "context-parallel.md"]
NOT_RUN = re.compile(r"<!--\s*not-run:\s*(.+?)\s*-->")
SLOW = re.compile(r"<!--\s*slow:\s*(.+?)\s*-->")
FLAG = re.compile(r"^--[a-z][a-z0-9-]*")
# Scripts whose flags pass through to launch/pretrain_gpt.py.
FORWARDERS = ("launch/local.sh", "launch/multinode.sh", "launch/main_job.sh", "launch/slurm_dgx2.sbatch")
PRETRAIN = "launch/pretrain_gpt.py"
# Only CUDA ranks log these (docs/tensorboard.md documents both the CPU and the GPU memory names).
GPU_ONLY_SCALARS = {"mem-allocated-bytes", "mem-max-allocated-bytes", "mem-reserved-bytes",
                    "mem-max-reserved-bytes", "mem-alloc-retries"}
# Only pipeline-parallel runs log these (tests/pretrain/test_pipeline_stage.py reads them from a real run).
PIPELINE_ONLY_SCALARS = {"pipeline/bubble-fraction", "comm/pp-bytes-per-step",
                         "comm/pp-cross-host-bytes-per-step"}
# Only --compile runs log these (the guides' logged runs do not compile).
COMPILE_ONLY_SCALARS = {"compile-time"}
# Only --async-save (checkpoint-*) and --max-restarts (restarts) runs log these (the guides' runs use
# neither; tests/checkpoint/test_async_save.py and tests/reliability/test_restarts.py run them).
OPERATIONS_ONLY_SCALARS = {"checkpoint-async-wait-time", "checkpoint-async-host-bytes",
                           "checkpoint-commit-time", "restarts"}
# Only --log-straggler runs log these (tests/pretrain/test_stragglers.py reads them from a real run).
STRAGGLER_ONLY_SCALARS = {f"straggler/{c}-seconds-{s}" for c in ("compute", "comm-wait", "data-wait")
                          for s in ("min", "median", "max")}
# Only mixture-of-experts runs log these (tests/moe/test_moe_metrics.py reads them from a real run).
MOE_ONLY_SCALARS = {"moe/load-max-over-mean", "moe/aux-loss", "moe/z-loss", "moe/dropped-fraction",
                    *(f"moe/layer<i>/{n}" for n in ("load-max-over-mean", "aux-loss", "z-loss",
                                                    "dropped-fraction", "tokens-per-expert/<e>"))}



@dataclass(frozen=True)
class Block:
    doc: str
    line: int            # 1-based line of the opening fence
    text: str
    not_run: str | None  # reason from <!-- not-run: ... -->, or None when the block runs
    slow: bool = False   # <!-- slow: ... -->: runs in the slow suite only

    def __str__(self) -> str:
        return f"docs/{self.doc}:{self.line}"


def bash_blocks(doc: str) -> list[Block]:
    """Every ```bash block of docs/<doc>, with the not-run reason of the line before it."""
    lines = (DOCS / doc).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            prev = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            mark = NOT_RUN.search(prev)
            end = lines.index("```", i + 1)
            blocks.append(Block(doc, i + 1, "\n".join(lines[i + 1:end]) + "\n",
                                mark.group(1) if mark else None, bool(SLOW.search(prev))))
            i = end
        i += 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for doc in ORDER for b in bash_blocks(doc)]


def segments(text: str) -> list[list[str]]:
    """Shell words of each simple command (continuations joined; split at ; && || | outside quotes)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        words: list[str] = []
        for tok in [*lexer, ";"]:
            if tok in (";", "&&", "||", "|", "&"):
                out.append(words) if words else None
                words = []
            else:
                words.append(tok)
    return out


def script_of(words: list[str]) -> tuple[str, int] | None:
    """(help key, index of the script word) of the repo script this command runs, if any."""
    for i, w in enumerate(words):
        if w == PRETRAIN or w in FORWARDERS:
            return PRETRAIN, i
        if w.startswith(("tools/", "benchmarks/")) and w.endswith(".py"):
            return w[:-3].replace("/", "."), i
        if w == "-m" and i + 1 < len(words) and words[i + 1].startswith(("tools.", "benchmarks.")):
            return words[i + 1], i + 1
    return None


@functools.cache
def help_text(key: str) -> str:
    cmd = [sys.executable, PRETRAIN] if key == PRETRAIN else [sys.executable, "-m", key]
    res = subprocess.run([*cmd, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{' '.join(cmd)} --help failed:\n{res.stderr[-2000:]}"
    return res.stdout


def test_every_guide_is_in_the_run_order():
    assert sorted(p.name for p in DOCS.glob("*.md")) == sorted(ORDER), \
        "add the new guide to ORDER in tests/project/test_docs.py so its commands run"


def test_guides_link_to_existing_files():
    for doc in ORDER:
        for target in re.findall(r"\]\(([^)#]+)\)", (DOCS / doc).read_text()):
            if not target.startswith("http"):
                assert (DOCS / target).exists(), f"docs/{doc} links to missing {target}"


def test_every_flag_exists_and_scripts_parse():
    """Each --flag after a repo script is in that script's --help; named scripts exist; bash -n."""
    uses = []   # (block, help key, flag)
    for block in all_blocks():
        for words in segments(block.text):
            for w in words:
                if w.startswith(("launch/", "tools/", "benchmarks/")):
                    assert (REPO / w).exists(), f"{block}: {w} does not exist"
                    if w.endswith((".sh", ".sbatch")):
                        res = subprocess.run(["bash", "-n", w], cwd=REPO, capture_output=True, text=True)
                        assert res.returncode == 0, f"{block}: bash -n {w}: {res.stderr}"
            found = script_of(words)
            if found is not None:
                key, at = found
                uses += [(block, key, m.group(0)) for m in map(FLAG.match, words[at + 1:]) if m]
    assert len(uses) > 100   # the parser really found the guides' commands
    with ThreadPoolExecutor(4) as pool:   # each --help imports torch: overlap them
        list(pool.map(help_text, sorted({key for _, key, _ in uses})))
    for block, key, flag in uses:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text(key)), \
            f"{block}: {flag} is not a flag of {key} (see its --help)"


def documented_scalars() -> set[str]:
    """First-column names of the scalar tables in docs/tensorboard.md, <category> expanded."""
    names = set()
    for row in re.findall(r"^\| (`.+?) \|", (DOCS / "tensorboard.md").read_text(), re.M):
        names.update(re.findall(r"`([^`]+)`", row))
    categories = {n.split("/")[1][:-len("-bytes")] for n in names
                  if n.startswith("model-state/") and "<" not in n}
    for n in [n for n in names if "<category>" in n]:
        names.discard(n)
        names.update(n.replace("<category>", c) for c in categories - {"buffers"})
    return names


def run_block(block: Block, work: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "NNODES", "MASTER")}
    # the guides run in the activated project environment: this interpreter's `python` first
    env.update(WORK=str(work), OMP_NUM_THREADS="1",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (f"{block} exited {res.returncode}:\n{block.text}\n--- stdout\n"
                                 f"{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-5000:]}")
    return res.stdout


def run_guides(work: Path, include_slow: bool) -> dict[Block, str]:
    """Run the runnable blocks in guide order (the slow ones too when asked); their outputs."""
    work.mkdir()
    blocks = [b for b in all_blocks() if b.not_run is None and (include_slow or not b.slow)]
    return {block: run_block(block, work) for block in blocks}


def test_guides_run(tmp_path):
    """Run every fast block in guide order; check the TensorBoard guide against the real tags."""
    work = tmp_path / "work"
    outputs = run_guides(work, include_slow=False)
    assert len(outputs) >= 15
    logged = set(next(out for b, out in outputs.items() if "EventAccumulator" in b.text).splitlines())
    assert "lm loss" in logged
    doc = documented_scalars()
    per_op = {n for n in doc if "<group>" in n}   # comm/<group>-<op>-...: one tag per op that ran
    matches = {p: {n for n in logged if re.fullmatch(
        re.escape(p).replace("<group>", "[a-z_]+").replace("<op>", "[a-z_]+"), n)} for p in per_op}
    assert all(matches.values()), f"no tag of these logged: {[p for p, m in matches.items() if not m]}"
    logged -= set().union(*matches.values())
    doc -= per_op
    assert logged <= doc, f"logged but not in docs/tensorboard.md: {sorted(logged - doc)}"
    unlogged = (doc - logged - GPU_ONLY_SCALARS - PIPELINE_ONLY_SCALARS - COMPILE_ONLY_SCALARS
                - OPERATIONS_ONLY_SCALARS - STRAGGLER_ONLY_SCALARS - MOE_ONLY_SCALARS)
    assert not unlogged, f"documented but not logged: {sorted(unlogged)}"
    assert (work / "ckpt" / "latest").read_text().strip() == "iter_0000005"   # the resharded resume saved
    assert (work / "hf" / "model.safetensors").exists() and (work / "paper" / "tables.md").exists()


@pytest.mark.slow
def test_all_guide_blocks_run_slow_ones_included(tmp_path):
    outputs = run_guides(tmp_path / "work", include_slow=True)
    assert sum(b.slow for b in outputs) >= 3   # the marks are found


if __name__ == "__main__":   # list the blocks and whether they run
    for b in all_blocks():
        print(b, "not-run: " + b.not_run if b.not_run else "runs (slow suite)" if b.slow else "runs")
