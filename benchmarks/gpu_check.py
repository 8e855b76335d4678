"""One command for the GPU questions: does the suite pass on the GPU, and how fast is fasttrans there?

Runs, each in its own subprocess with its own timeout, in this order (what the open
questions need most first; the budget cuts from the end):

    env        nvidia-smi, torch / triton versions, ``python -m fasttrans info`` (which also
               builds the C++/CUDA extension, once, for every later part)
    tests      ``pytest tests -m gpu`` (pytest-xdist workers when installed, at most ten
               failures, --timeout with pytest-timeout)
    host       benchmarks/bench_host.py, when the checkout has it
    attention  fp16, D 64/128, L 128/1024/4096, masks none/causal/key_padding/dense_padding/
               dense_bool, fwd and fwd+bwd, the Triton backend against
               F.scaled_dot_product_attention
    hf         Hugging Face models (bench_model.py's hf and hf-families sweeps) in bf16:
               BERT-base-shaped and Llama-shaped training steps and Llama generate(), a
               small training step of each of the six tested families and of gpt-oss (its
               attention sinks) and gpt-oss's generate(), fasttrans's apply() against
               attn_implementation "sdpa" (and "eager"; gpt-oss: "eager"), and the 12 longest GPU
               kernels of each provider's hf training steps; skipped without transformers
    model      training step of the demo (digits-average) model and of the base model
    norms      4096 x {1024, 8192} in fp32, layer_norm / add_layer_norm / rms_norm
    tests      then the extension's GPU tests
    attention  then fp16 at L 4096 with the forward's keys and values by pointer loads
               instead of TMA (rows marked "pointer loads"), and the bf16 sweep
    norms      then fp16
    dropout    the dropout sweeps, when time remains

Every benchmark part appends its rows to ``<out-dir>/<device>.csv`` (benchmarks/common.py),
so a run cut short keeps what it measured. After each part a table of its rows (median,
speedup against torch) is printed; at the end, the status of every part. Each part's output
goes to ``<out-dir>/gpu-check/<part>.log`` (its tail is printed when it fails), the status
table to ``<out-dir>/gpu-check/status.csv`` (rewritten after every part) and copies of the
plots each part drew to ``<out-dir>/gpu-check/plots/``.

A global budget (``--budget-s``, default 480) bounds the whole run: a part starts only when
at least its minimum time is left, and runs at most until the budget ends; the parts that
no longer fit are skipped with the reason.

    make gpu-check                                   # on a machine with a CUDA GPU
    python benchmarks/gpu_check.py --parts env,attention --budget-s 300 --out-dir /tmp/r
    python benchmarks/gpu_check.py --dry-run         # any machine: commands, timeouts, checks
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
DEFAULT_BUDGET_S = 480.0
RESERVE_S = 5.0  # kept back from the budget for the final summary
KILL_GRACE_S = 5.0  # after SIGINT (tracebacks, pytest's summary) before SIGKILL
FAILURE_TAIL_LINES = 30

# The providers timed: fasttrans' two GPU backends and eager torch. The reference backend
# is an unfused oracle, and torch-compile recompiles every configuration (seconds each),
# which this time budget cannot afford. A plain 'torch' filter would also select
# torch-compile (benchmarks/common.py: provider_selected); the glob matches eager torch only.
PROVIDERS = "fasttrans-triton,fasttrans-extension,torc[h]"
# The attention sweeps time the Triton backend alone: the extension's CUDA attention is the
# fallback for GPUs without Triton, and leaving it out lets both lengths fit the part's time.
TRITON_PROVIDERS = "fasttrans-triton,torc[h]"


@dataclasses.dataclass(frozen=True)
class Part:
    """One step of the check: a command, its timeout and how to report it."""

    name: str
    argv: tuple[str, ...]
    timeout_s: float
    min_s: float = 0.0  # the least time worth starting it with; with less left it is skipped
    group: str = ""  # --parts selects a part by its name or its group
    requires: tuple[str, ...] = ()  # paths (relative to the repository) that must exist, else skipped
    check_argv: tuple[str, ...] | None = None  # --dry-run runs this (on CPU) to check scripts and options
    bench: bool = False  # writes CSV rows: summarised from the CSV; else by the log's last lines
    show_lines: int = 3  # log lines printed when it succeeds (parts without rows)

    @property
    def selector(self) -> str:
        return self.group or self.name


@dataclasses.dataclass
class Outcome:
    name: str
    status: str  # "ok", "failed", "timed out", "skipped"
    seconds: float = 0.0
    rc: int | None = None
    reason: str = ""
    rows: int = 0
    row_errors: int = 0
    log: Path | None = None

    @property
    def label(self) -> str:
        if self.status == "failed":
            return f"failed rc={self.rc}"
        return self.status


# --------------------------------------------------------------------------------------
# the parts
# --------------------------------------------------------------------------------------
def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def cpu_check(argv: Sequence[str]) -> tuple[str, ...]:
    """The same benchmark command on CPU with --list: argparse and the script's own checks
    validate every option and value, and nothing is measured or written."""
    out = list(argv)
    if "--device" in out:
        out[out.index("--device") + 1] = "cpu"
    return (*out, "--list")


def bench_part(name: str, script: str, args: Sequence[str], out_dir: Path, python: str, timeout_s: float,
               min_s: float, group: str, check_args: Sequence[str] | None = None) -> Part:
    argv = (python, f"benchmarks/{script}", "--device", "cuda", *args, "--out-dir", str(out_dir))
    check = None if check_args is None else (python, f"benchmarks/{script}", "--device", "cuda", *check_args,
                                             "--out-dir", str(out_dir))
    return Part(name, argv, timeout_s, min_s, group=group, requires=(f"benchmarks/{script}",),
                check_argv=cpu_check(check or argv), bench=True)


def build_parts(out_dir: Path, python: str = sys.executable, xdist: bool | None = None,
                pytest_timeout: bool | None = None) -> list[Part]:
    """Every part, in the order they run. Their timeouts add up to more than the default
    budget on purpose: the budget decides how far a run gets, the timeouts how much one part
    may take of it."""
    xdist = has_module("xdist") if xdist is None else xdist
    pytest_timeout = has_module("pytest_timeout") if pytest_timeout is None else pytest_timeout
    # up to ten failures, not one: a single failing test would hide whether the rest pass
    tests = [python, "-m", "pytest", "tests", "-m", "gpu", "-q", "--maxfail", "10"]
    if xdist:  # workers share the GPU: the suite is mostly compilation (one core each) and small kernels
        tests += ["-n", str(max(2, min(8, (os.cpu_count() or 8) // 2)))]
    if pytest_timeout:  # a hung test fails alone instead of taking the part's whole time
        tests += ["--timeout", "90"]
    # the extension's tests apart: when it cannot be built, each of its tests fails at setup,
    # and those failures would stop the Triton kernels' tests
    extension_tests = (*tests, "-k", "extension")
    tests += ["-k", "not extension"]
    # L 128: the B=128 H=32 D=64 shape of the host-cost goals, launch-bound
    attention = ["--sweep", "sweep", "--head-dim", "64,128", "--seq-len", "128,1024,4096",
                 "--mask", "none,causal,key_padding,dense_padding,dense_bool", "--mode", "fwd,fwd+bwd",
                 "--provider", TRITON_PROVIDERS]
    pointer_loads = ["--dtype", "float16", "--loads", "pointer", "--sweep", "sweep", "--head-dim", "64,128",
                     "--mask", "none,causal", "--mode", "fwd,fwd+bwd", "--provider", TRITON_PROVIDERS,
                     "--seq-len"]
    norms = ["--sweep", "sweep", "--hidden", "1024,8192", "--op", "layer_norm,add_layer_norm,rms_norm",
             "--mode", "fwd,fwd+bwd", "--provider", PROVIDERS]
    return [
        # the first `fasttrans info` builds the extension (nvcc): most of this part's time
        Part("env", (python, "benchmarks/gpu_check.py", "--env-report", "--out-dir", str(out_dir)), 180, 30,
             show_lines=12),
        Part("tests", tuple(tests), 150, 45, group="tests", show_lines=3),
        # compiling the layer's kernels, cold, takes most of it
        bench_part("host", "bench_host.py", [], out_dir, python, 90, 20, "host"),
        bench_part("attention-float16", "bench_attention.py", ["--dtype", "float16", *attention], out_dir, python,
                   150, 40, "attention"),
        # needs transformers (the test extra); without it the sweep's rows say UNAVAILABLE
        bench_part("hf", "bench_model.py",
                   ["--sweep", "hf,hf-families", "--dtype", "bfloat16", "--provider", PROVIDERS,
                    "--kernel-profile", "12"],
                   out_dir, python, 120, 40, "hf"),
        # headline: the demo (digits-average) model's training step; train: the base model's,
        # a CUDA-only sweep, so the CPU check lists the headline alone
        bench_part("model", "bench_model.py", ["--sweep", "headline,train", "--provider", PROVIDERS], out_dir,
                   python, 90, 45, "model", check_args=["--sweep", "headline", "--provider", PROVIDERS]),
        # the layer_norm 4096 x 1024 fp32 forward of the host-cost goals
        bench_part("norms-float32", "bench_layernorm.py", ["--dtype", "float32", *norms], out_dir, python,
                   45, 20, "norms"),
        Part("tests-extension", extension_tests, 90, 30, group="tests", show_lines=3),
        # the forward's keys and values by pointer loads: against attention-float16's rows
        bench_part("attention-pointer-loads", "bench_attention.py", [*pointer_loads, "4096"], out_dir, python, 60, 30,
                   "attention", check_args=[*pointer_loads, "1024"]),  # the CPU sweep stops at 2048
        bench_part("attention-bfloat16", "bench_attention.py", ["--dtype", "bfloat16", *attention], out_dir, python,
                   90, 40, "attention"),
        bench_part("norms-float16", "bench_layernorm.py", ["--dtype", "float16", *norms], out_dir, python,
                   45, 20, "norms"),
        bench_part("dropout", "bench_dropout.py", ["--sweep", "headline,sweep", "--provider", PROVIDERS], out_dir,
                   python, 45, 20, "dropout"),
    ]


def select_parts(parts: Sequence[Part], names: Sequence[str]) -> list[Part]:
    if not names:
        return list(parts)
    known = list(dict.fromkeys([p.selector for p in parts] + [p.name for p in parts]))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--parts: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return [p for p in parts if p.name in names or p.selector in names]


# --------------------------------------------------------------------------------------
# running one part
# --------------------------------------------------------------------------------------
def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Current:
    """The running part's process, for the signal handler."""

    proc: subprocess.Popen | None = None


def run_command(argv: Sequence[str], timeout_s: float, log_path: Path, env: dict | None = None,
                kill_grace_s: float = KILL_GRACE_S) -> tuple[int | None, float, bool]:
    """Run ``argv`` in the repository with its output in ``log_path``: (rc, seconds, timed out).

    The command gets a process group of its own, so that a timeout stops everything it
    started (pytest's workers, the compilers of an extension build): SIGINT first, which
    makes Python print where it was and pytest its summary, then SIGKILL. The output goes
    straight to the file, so what a killed command printed is kept.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(argv)}\n# timeout {timeout_s:.0f} s, started {time.strftime('%H:%M:%S')}\n")
        log.flush()
        proc = subprocess.Popen(list(argv), cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        _Current.proc = proc
        timed_out = False
        try:
            rc: int | None = proc.wait(timeout=max(timeout_s, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc, signal.SIGINT)
            try:
                proc.wait(timeout=kill_grace_s)
            except subprocess.TimeoutExpired:
                pass
            _kill_group(proc, signal.SIGKILL)
            proc.wait()
            rc = None
        finally:
            _kill_group(proc, signal.SIGKILL)  # whatever it left behind would hold the GPU
            _Current.proc = None
        seconds = time.monotonic() - start
        if timed_out:
            log.write(f"\n# gpu_check: timed out after {timeout_s:.0f} s: stopped\n")
    return rc, seconds, timed_out


def tail(path: Path, lines: int) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


# --------------------------------------------------------------------------------------
# reading back the rows a part wrote
# --------------------------------------------------------------------------------------
def snapshot(out_dir: Path, pattern: str) -> dict[Path, tuple[int, float]]:
    """{file: (size, mtime)} of the files matching ``pattern`` in ``out_dir``."""
    out = {}
    for f in out_dir.glob(pattern):
        try:
            st = f.stat()
        except OSError:
            continue
        out[f] = (st.st_size, st.st_mtime)
    return out


def new_rows(out_dir: Path, before: dict[Path, tuple[int, float]]) -> list[dict[str, str]]:
    """The CSV rows appended since ``before`` (a snapshot of ``*.csv``); a row cut short by a
    killed writer is left out."""
    rows: list[dict[str, str]] = []
    for f in sorted(out_dir.glob("*.csv")):
        try:
            data = f.read_bytes()
        except OSError:
            continue
        offset = before.get(f, (0, 0.0))[0]
        if len(data) <= offset:
            continue
        text = data.decode(errors="replace")
        header = next(csv.reader(io.StringIO(text)), [])
        reader = csv.reader(io.StringIO(data[offset:].decode(errors="replace") if offset else text))
        for values in reader:
            if len(values) == len(header) and values != header:
                rows.append(dict(zip(header, values)))
    return rows


SHORT_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}


def rows_table(rows: Sequence[dict[str, str]], max_errors: int = 5) -> list[str]:
    """One line per configuration, one column per provider: median ms and speedup vs torch
    (torch's median / the provider's), or the row's status when it has no number."""
    if not rows:
        return ["  (no rows)"]
    configs: dict[tuple, dict[str, dict[str, str]]] = {}
    providers: list[str] = []
    for r in rows:
        label = r.get("case") or r.get("params", "")
        key = (r.get("benchmark", ""), r.get("op", ""), r.get("mode", ""), SHORT_DTYPES.get(r.get("dtype", ""),
               r.get("dtype", "")), label)
        who = r.get("provider", "?") + (f"[{r['variant']}]" if r.get("variant") else "")
        configs.setdefault(key, {})[who] = r
        if who not in providers:
            providers.append(who)
    seen = list(providers)
    providers.sort(key=lambda p: (not p.startswith("torch"), seen.index(p)))  # the baseline first
    labels = {key: " ".join(k for k in key[1:] if k) for key in configs}
    width = min(max(len(t) for t in labels.values()), 72)
    cells: dict[tuple, list[str]] = {}
    for key, by in configs.items():
        line = []
        for p in providers:
            r = by.get(p)
            if r is None:
                line.append("-")
            elif r.get("status") != "ok" or not r.get("median_ms"):
                line.append({"unavailable": "unavail."}.get(r.get("status", ""), r.get("status", "?")))
            else:
                cell = f"{float(r['median_ms']):.3f}"
                if r.get("speedup_vs_torch") and not p.startswith("torch"):
                    cell += f" ({float(r['speedup_vs_torch']):.2f}x)"
                line.append(cell)
        cells[key] = line
    col = [max(len(p), *(len(cells[k][i]) for k in configs)) for i, p in enumerate(providers)]
    title = "configuration (ms, speedup vs torch)"
    out = [f"  {title:{width}s}  " + "  ".join(f"{p:>{c}s}" for p, c in zip(providers, col))]
    for key in configs:
        text = labels[key] if len(labels[key]) <= width else labels[key][:width - 3] + "..."
        out.append(f"  {text:{width}s}  " + "  ".join(f"{v:>{c}s}" for v, c in zip(cells[key], col)))
    errors = [r for r in rows if r.get("status") == "error"]
    for r in errors[:max_errors]:
        msg = r.get("error", "")
        out.append(f"  ERROR {r.get('provider')} {r.get('op')} {r.get('mode')} {r.get('params')}: "
                   f"{msg if len(msg) <= 200 else msg[:197] + '...'}")
    if len(errors) > max_errors:
        out.append(f"  ... and {len(errors) - max_errors} more error rows (status=error in the CSV)")
    return out


# --------------------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------------------
def write_status(path: Path, outcomes: Sequence[Outcome]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["part", "status", "rc", "seconds", "rows", "error_rows", "reason", "log"])
        for o in outcomes:
            w.writerow([o.name, o.status, "" if o.rc is None else o.rc, f"{o.seconds:.1f}", o.rows, o.row_errors,
                        o.reason, o.log or ""])


def status_table(outcomes: Sequence[Outcome]) -> list[str]:
    out = [f"  {'part':20s} {'status':14s} {'seconds':>8s} {'rows':>5s}  note"]
    for o in outcomes:
        rows = f"{o.rows}" if o.rows else "-"
        note = o.reason
        if o.row_errors:
            note = f"{o.row_errors} error rows; " + note
        out.append(f"  {o.name:20s} {o.label:14s} {o.seconds:8.1f} {rows:>5s}  {note}".rstrip())
    return out


def run_parts(parts: Sequence[Part], budget_s: float, out_dir: Path, env: dict | None = None,
              print_fn: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic,
              reserve_s: float = RESERVE_S, kill_grace_s: float = KILL_GRACE_S,
              outcomes: list[Outcome] | None = None) -> list[Outcome]:
    """Run ``parts`` in order within ``budget_s`` seconds; one Outcome per part.

    A part whose required file is missing, or that gets less than its ``min_s`` of the
    budget, is skipped with the reason; the others run with the smaller of their timeout and
    what is left. A part that fails or times out does not stop the next. ``outcomes``, when
    given, is appended to as the parts finish (a caller stopped half-way still has them).
    """
    start = clock()
    log_dir = out_dir / "gpu-check"
    outcomes = [] if outcomes is None else outcomes
    for i, part in enumerate(parts, 1):
        head = f"== [{i}/{len(parts)}] {part.name}"
        missing = [r for r in part.requires if not (REPO / r).exists()]
        left = budget_s - (clock() - start) - reserve_s
        if missing:
            outcome = Outcome(part.name, "skipped", reason=f"{', '.join(missing)} missing")
        elif left < part.min_s:
            outcome = Outcome(part.name, "skipped",
                              reason=f"needs at least {part.min_s:.0f} s, {max(left, 0):.0f} s of the "
                                     f"{budget_s:.0f} s budget left")
        else:
            outcome = None
        if outcome is not None:
            print_fn(f"{head}: skipped ({outcome.reason})")
            outcomes.append(outcome)
            write_status(log_dir / "status.csv", outcomes)
            continue
        timeout = min(part.timeout_s, left - kill_grace_s)
        cut = f", cut from {part.timeout_s:.0f} s by the budget" if timeout < part.timeout_s else ""
        print_fn(f"{head}: timeout {timeout:.0f} s{cut}")
        print_fn(f"   $ {shlex.join(part.argv)}")
        log = log_dir / f"{part.name}.log"
        csvs, pngs = snapshot(out_dir, "*.csv"), snapshot(out_dir, "*.png")
        rc, seconds, timed_out = run_command(part.argv, timeout, log, env, kill_grace_s)
        if timed_out:
            outcome = Outcome(part.name, "timed out", seconds, reason=f"stopped after {timeout:.0f} s; log {log.name}",
                              log=log)
        elif rc == 0:
            outcome = Outcome(part.name, "ok", seconds, rc, log=log)
        else:
            outcome = Outcome(part.name, "failed", seconds, rc, reason=f"log {log.name}", log=log)
        print_fn(f"{head}: {outcome.label} in {seconds:.1f} s (log: {_rel(log)})")
        if part.bench:
            try:  # a row that cannot be read back must not end the run
                rows = new_rows(out_dir, csvs)
                outcome.rows = len(rows)
                outcome.row_errors = sum(r.get("status") == "error" for r in rows)
                for line in rows_table(rows):
                    print_fn(line)
                copy_plots(out_dir, pngs, part.name)
            except Exception as e:
                print_fn(f"  (reading back the rows or plots failed: {type(e).__name__}: {e})")
        if outcome.status != "ok":
            print_fn(f"   --- last {FAILURE_TAIL_LINES} lines of {_rel(log)}:")
            for line in tail(log, FAILURE_TAIL_LINES):
                print_fn(f"   | {line}")
        elif not part.bench:
            for line in tail(log, part.show_lines):
                print_fn(f"   | {line}")
        outcomes.append(outcome)
        write_status(log_dir / "status.csv", outcomes)
    return outcomes


def copy_plots(out_dir: Path, before: dict[Path, tuple[int, float]], part: str) -> None:
    """Copy the PNGs a part wrote to gpu-check/plots/<part>-<name>: the fp16 and bf16 runs of a
    script draw to the same file name, so the second would replace the first."""
    dest = out_dir / "gpu-check" / "plots"
    for f, stamp in snapshot(out_dir, "*.png").items():
        if before.get(f) != stamp:
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest / f"{part}-{f.name}")


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


SYSTEM_CXX = "/usr/bin/g++"


def child_env(cxx: str | None = None) -> dict:
    """The parts' environment: unbuffered output, and the C++ compiler of the extension build:
    ``cxx`` when given, else the system g++ when there is one, else the environment's CXX.
    The system compiler wins over CXX because the images of GPU machines set CXX to a
    relocated g++ that links a static C++ runtime, which gets the extension refused
    (docs/backends.md)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # the log keeps every line a killed part printed
    if cxx:
        env["CXX"] = cxx
    elif Path(SYSTEM_CXX).exists():
        env["CXX"] = SYSTEM_CXX
    return env


def installed_problem() -> str | None:
    """Why this Python cannot run fasttrans from this checkout, else None. Its kernels and
    extension sources are packages only once installed (setup.py maps kernels/ and csrc/),
    so a bare checkout on the path would leave every fasttrans provider unavailable."""
    try:
        spec = importlib.util.find_spec("fasttrans.kernels")
    except Exception as e:  # fasttrans itself failed to import
        return f"fasttrans failed to import: {type(e).__name__}: {e}"
    if spec is None or spec.origin is None:
        return "fasttrans is not installed in this Python"
    if not Path(spec.origin).resolve().is_relative_to(REPO):
        return f"the fasttrans installed in this Python is another checkout's ({Path(spec.origin).parents[1]})"
    return None


INSTALL_HINT = ("install this checkout first: `make gpu-check` does, or, offline, with the machine's own torch: "
                "python -m pip install --no-deps --no-build-isolation --no-index -e .")


# --------------------------------------------------------------------------------------
# --dry-run
# --------------------------------------------------------------------------------------
RESULTS_MARK = "gpu-check-results: "


def check_scripts(argvs: Sequence[Sequence[str]], env: dict, timeout_s: float = 240) -> list[tuple[int, str]]:
    """(exit status, output) of each script command (``python script args...``), all run in one
    child process (``--check-commands``): it imports torch and fasttrans once for all of them."""
    if not argvs:
        return []
    try:
        r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--check-commands"], cwd=REPO, env=env,
                           input=json.dumps([list(a) for a in argvs]), capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [(-1, f"the checks did not finish in {timeout_s:.0f} s")] * len(argvs)
    found = [line for line in r.stdout.splitlines() if line.startswith(RESULTS_MARK)]
    if not found:
        why = f"the checking process exited {r.returncode} without results:\n" + (r.stdout + r.stderr)[-2000:]
        return [(-1, why)] * len(argvs)
    return [(rc, text) for rc, text in json.loads(found[-1][len(RESULTS_MARK):])]


def check_commands() -> int:
    """--check-commands: run each ``[python, script, args...]`` of the JSON list on stdin as
    ``python script args...`` would (runpy, as __main__), its output captured; print the
    list of (exit status, output) after RESULTS_MARK."""
    import contextlib
    import io
    import runpy
    import traceback

    results = []
    for argv in json.load(sys.stdin):
        buffer = io.StringIO()
        saved_argv = sys.argv
        sys.argv = list(argv[1:])
        rc = 0
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            try:
                runpy.run_path(str(REPO / argv[1]), run_name="__main__")
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    print(e.code)
            except BaseException:
                traceback.print_exc()
                rc = 1
            finally:
                sys.argv = saved_argv
        results.append((rc, buffer.getvalue()))
    print(RESULTS_MARK + json.dumps(results), flush=True)
    return 0


def check_part(part: Part, script_result: tuple[int, str] | None) -> tuple[bool, str]:
    """(passed, what was found) for one part, without measuring anything; ``script_result``
    is what its ``check_argv`` gave (check_scripts)."""
    missing = [r for r in part.requires if not (REPO / r).exists()]
    if missing:
        return True, f"would be skipped: {', '.join(missing)} missing"
    if part.name == "env":
        smi = shutil.which("nvidia-smi")
        return True, f"nvidia-smi {'at ' + smi if smi else 'not found here'}; fasttrans " + (
            "importable" if has_module("fasttrans") else "NOT importable")
    if part.name == "tests":
        if not has_module("pytest"):
            return False, "pytest is not installed"
        ini = (REPO / "pytest.ini").read_text() if (REPO / "pytest.ini").exists() else ""
        if "gpu:" not in ini:
            return False, "pytest.ini declares no 'gpu' marker"
        workers = part.argv[part.argv.index("-n") + 1] if "-n" in part.argv else None
        return True, (f"pytest-xdist {'found: -n ' + workers if workers else 'not installed: serial'}, "
                      f"pytest-timeout {'found: --timeout 90' if has_module('pytest_timeout') else 'not installed'}")
    if part.check_argv is None or script_result is None:
        return True, "nothing to check"
    rc, output = script_result
    lines = output.strip().splitlines()
    command = shlex.join(part.check_argv[1:])
    if rc != 0:
        return False, f"`{command}` exited {rc}:\n" + "\n".join(f"      | {line}" for line in lines[-12:])
    listed = next((line.strip() for line in reversed(lines) if "configurations" in line), "listed")
    return True, f"--device cpu --list (the CPU's sizes): {listed}"


def dry_run(parts: Sequence[Part], budget_s: float, out_dir: Path, print_fn: Callable[[str], None] = print) -> int:
    print_fn(f"gpu-check --dry-run: {len(parts)} parts, budget {budget_s:.0f} s, results in {out_dir}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # the CPU checks keep the compiler of the extension's cache
    to_check = [p for p in parts if p.check_argv is not None and all((REPO / r).exists() for r in p.requires)]
    results = dict(zip([p.name for p in to_check], check_scripts([p.check_argv for p in to_check], env)))
    failed = 0
    for i, part in enumerate(parts, 1):
        ok, what = check_part(part, results.get(part.name))
        print_fn(f"[{i}/{len(parts)}] {part.name}: timeout {part.timeout_s:.0f} s, skipped with less than "
                 f"{part.min_s:.0f} s left; log {_rel(out_dir / 'gpu-check' / (part.name + '.log'))}")
        print_fn(f"   $ {shlex.join(part.argv)}")
        print_fn(f"   check: {'ok' if ok else 'FAILED'}: {what}")
        failed += not ok
    total = sum(p.timeout_s for p in parts)
    print_fn(f"timeouts add up to {total:.0f} s against a budget of {budget_s:.0f} s: when earlier parts take "
             f"their whole time, later ones are cut or skipped")
    print_fn("dry run: nothing was measured" + (f"; {failed} FAILED checks" if failed else "; every check passed"))
    return 1 if failed else 0


# --------------------------------------------------------------------------------------
# --env-report (the env part)
# --------------------------------------------------------------------------------------
def env_report(out_dir: Path) -> int:
    summary = []
    smi = shutil.which("nvidia-smi")
    if smi:
        for args in (["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], []):
            try:
                r = subprocess.run([smi, *args], capture_output=True, text=True, timeout=30)
                print(r.stdout + r.stderr)
                if args and r.returncode == 0:
                    summary += [f"nvidia-smi   {line.strip()}" for line in r.stdout.strip().splitlines()]
            except (OSError, subprocess.SubprocessError) as e:
                print(f"nvidia-smi {' '.join(args)}: {e}")
    else:
        summary.append("nvidia-smi   not found")
    import torch

    cuda = torch.cuda.is_available()
    name = f"{torch.cuda.get_device_name()} sm_{''.join(map(str, torch.cuda.get_device_capability()))}" if cuda \
        else "no CUDA device visible to torch"
    summary.append(f"torch        {torch.__version__} (CUDA {torch.version.cuda or 'none'}): {name}")
    try:
        import triton

        summary.append(f"triton       {triton.__version__}")
    except Exception as e:
        summary.append(f"triton       not importable ({type(e).__name__}: {e})")
    summary.append(f"CXX          {os.environ.get('CXX', '(unset)')}")
    summary.append(f"compilers    {SYSTEM_CXX} {'found' if Path(SYSTEM_CXX).exists() else 'missing'}; "
                   f"on PATH: g++ {shutil.which('g++')}, c++ {shutil.which('c++')}, nvcc {shutil.which('nvcc')}")
    sys.stdout.flush()
    rc = 0
    try:  # a broken import still leaves the lines above in the summary
        from fasttrans import backends, cli, extension

        start = time.monotonic()
        rc = cli.main(["info"])  # builds the extension when it is not in the cache yet
        sys.stdout.flush()
        summary.append(f"info         rc {rc} in {time.monotonic() - start:.1f} s (extension build included)")
        info = extension.build_info()
        summary.append(f"extension    built={info.get('built')} with_cuda={info.get('with_cuda')} "
                       f"arch={info.get('cuda_archs') or '-'} error={info.get('error')}")
        if cuda:
            for bname, backend in backends.BACKENDS.items():
                states = []
                for op in backends.OPS:
                    why = backend.unavailable_reason("cuda", op)
                    states.append(f"{op} {'ok' if why is None else 'NO: ' + why[:80]}")
                summary.append(f"{bname:12s} on cuda: {'; '.join(states)}")
        sys.path.append(str(REPO))
        from benchmarks.common import FIELDS

        for f in sorted(out_dir.glob("*.csv")):  # the benchmarks refuse to append to such a file
            with open(f, newline="") as fh:
                if tuple(next(csv.reader(fh), [])) != FIELDS:
                    summary.append(f"WARNING      {f.name} has other columns than benchmarks/common.py writes: "
                                   f"move it away or pass another --out-dir")
    except Exception:
        import traceback

        traceback.print_exc()
        summary.append(f"fasttrans    FAILED: {traceback.format_exc().strip().splitlines()[-1]}")
        rc = 1
    print("\n== env summary")
    for line in summary:
        print(line)
    return rc


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", action="append", default=[], metavar="NAME",
                   help="run only these parts (names or groups, comma-separated or repeated): env, tests, host, "
                        "attention, norms, model, dropout, or one dtype's part such as attention-float16")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"wall-clock budget of the whole run in seconds (default {DEFAULT_BUDGET_S:.0f})")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR,
                   help="where the CSV rows and plots go, and the logs under gpu-check/ (default benchmarks/results)")
    p.add_argument("--dry-run", action="store_true",
                   help="print each part's command and timeout, check scripts and options on CPU, measure nothing")
    p.add_argument("--cxx", metavar="PATH",
                   help=f"C++ compiler of the extension build (default {SYSTEM_CXX} when it exists, else $CXX)")
    p.add_argument("--env-report", action="store_true", help=argparse.SUPPRESS)  # the env part's own command
    p.add_argument("--check-commands", action="store_true", help=argparse.SUPPRESS)  # --dry-run's checker
    args = p.parse_args(argv)
    if args.env_report:
        return env_report(args.out_dir)
    if args.check_commands:
        return check_commands()
    out_dir = args.out_dir.resolve()
    names = [n.strip() for value in args.parts for n in value.split(",") if n.strip()]
    parts = select_parts(build_parts(out_dir), names)
    problem = installed_problem()
    if problem:
        print(f"gpu-check: {problem}; {INSTALL_HINT}", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(parts, args.budget_s, out_dir)

    env = child_env(args.cxx)
    print(f"gpu-check: {len(parts)} parts within {args.budget_s:.0f} s; results in {out_dir}, "
          f"logs in {out_dir / 'gpu-check'}; CXX={env.get('CXX', '(unset)')}")
    sys.stdout.flush()

    outcomes: list[Outcome] = []
    start = time.monotonic()

    def summary() -> None:
        print(f"\n== gpu-check summary: {time.monotonic() - start:.0f} s of the {args.budget_s:.0f} s budget")
        for line in status_table(outcomes):
            print(line)
        print(f"rows: {out_dir}/*.csv   logs and status.csv: {out_dir / 'gpu-check'}", flush=True)

    def stop(signum, frame):  # the run itself was cut: end the running part with it, say what finished
        if _Current.proc is not None:
            _kill_group(_Current.proc, signal.SIGKILL)
        print(f"\ngpu-check: stopped by signal {signum} during part {len(outcomes) + 1}", flush=True)
        summary()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def emit(line: str) -> None:
        print(line, flush=True)

    run_parts(parts, args.budget_s, out_dir, env, print_fn=emit, outcomes=outcomes)
    summary()
    return 0 if all(o.status in ("ok", "skipped") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
