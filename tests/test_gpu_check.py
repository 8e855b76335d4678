"""benchmarks/gpu_check.py: the dry run on CPU, and the runner's budget, timeouts and read-back.

The runner is tested with tiny stand-in parts (``python -c ...``) rather than the real
benchmarks: what matters here is that a part that fails, hangs or does not fit never stops
the parts after it, and that each says what happened to it.
"""

import csv
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # `benchmarks` is a directory of scripts; last: see conftest.py

from benchmarks import gpu_check  # noqa: E402
from benchmarks.gpu_check import Part  # noqa: E402

PY = sys.executable


def py(code: str) -> tuple[str, ...]:
    return (PY, "-c", code)


def run(parts, budget_s, out_dir, **kw):
    printed = []
    outcomes = gpu_check.run_parts(parts, budget_s, out_dir, print_fn=printed.append, **kw)
    return outcomes, "\n".join(printed)


def test_dry_run_lists_every_part_with_its_command_and_timeout(tmp_path):
    r = subprocess.run([PY, "benchmarks/gpu_check.py", "--dry-run", "--out-dir", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    expected = [p.name for p in gpu_check.build_parts(tmp_path)]
    assert expected[:3] == ["env", "tests", "host"] and "dropout" == expected[-1]
    found = []
    for i, line in enumerate(lines):
        m = re.match(r"\[(\d+)/(\d+)\] (\S+): timeout (\d+) s", line)
        if m:
            found.append(m.group(3))
            assert int(m.group(4)) > 0
            assert lines[i + 1].lstrip().startswith("$ "), lines[i + 1]
            assert re.match(r"\s+check: ok: ", lines[i + 2]), lines[i + 2]
    assert found == expected, r.stdout
    assert "nothing was measured" in r.stdout
    assert not (tmp_path / "gpu-check").exists()  # a dry run writes nothing


def test_a_script_check_that_fails_fails_the_dry_run(tmp_path):
    part = next(p for p in gpu_check.build_parts(tmp_path) if p.name == "dropout")
    ok, what = gpu_check.check_part(part, (2, "usage: ...\nbench_dropout.py: error: unrecognized arguments: --nope"))
    assert not ok and "exited 2" in what and "unrecognized arguments: --nope" in what
    assert "--device cpu" in shlex.join(part.check_argv) and part.check_argv[-1] == "--list"
    assert gpu_check.check_part(part, (0, "12 configurations (--list: nothing was run)"))[0]


def test_parts_select_by_name_and_group(tmp_path):
    parts = gpu_check.build_parts(tmp_path)
    names = [p.name for p in gpu_check.select_parts(parts, ["attention", "env"])]
    assert names == ["env", "attention-float16", "attention-pointer-loads", "attention-bfloat16"]
    assert [p.name for p in gpu_check.select_parts(parts, ["norms-float32"])] == ["norms-float32"]


def test_the_test_part_uses_xdist_and_pytest_timeout_only_when_installed(tmp_path):
    def tests_argv(**found):
        return next(p for p in gpu_check.build_parts(tmp_path, **found) if p.name == "tests").argv

    with_both = tests_argv(xdist=True, pytest_timeout=True)
    assert with_both[1:9] == ("-m", "pytest", "tests", "-m", "gpu", "-q", "--maxfail", "10")
    assert "-n" in with_both and "--timeout" in with_both
    without = tests_argv(xdist=False, pytest_timeout=False)
    assert "-n" not in without and "--timeout" not in without


def test_the_extension_tests_run_apart_from_the_others(tmp_path):
    parts = gpu_check.select_parts(gpu_check.build_parts(tmp_path), ["tests"])
    assert [p.name for p in parts] == ["tests", "tests-extension"]
    assert parts[0].argv[-2:] == ("-k", "not extension") and parts[1].argv[-2:] == ("-k", "extension")


def test_the_checkout_is_installed_where_the_check_runs():
    assert gpu_check.installed_problem() is None


def test_the_extension_is_built_by_the_compiler_asked_for(monkeypatch):
    monkeypatch.setenv("CXX", "/opt/relocated/bin/g++")
    assert gpu_check.child_env("/some/g++")["CXX"] == "/some/g++"
    system = Path(gpu_check.SYSTEM_CXX).exists()
    assert gpu_check.child_env()["CXX"] == (gpu_check.SYSTEM_CXX if system else "/opt/relocated/bin/g++")


def test_a_part_that_does_not_fit_the_budget_is_skipped_and_the_next_runs(tmp_path):
    parts = [
        Part("too-long", py("print('never')"), timeout_s=60, min_s=100),
        Part("missing", py("print('never')"), timeout_s=5, requires=("benchmarks/no_such_script.py",)),
        Part("fits", py("print('ran')"), timeout_s=5),
    ]
    outcomes, printed = run(parts, budget_s=30, out_dir=tmp_path, reserve_s=0)
    assert [o.status for o in outcomes] == ["skipped", "skipped", "ok"]
    assert "needs at least 100 s" in outcomes[0].reason and "budget" in outcomes[0].reason
    assert outcomes[1].reason == "benchmarks/no_such_script.py missing"
    assert "ran" in (tmp_path / "gpu-check" / "fits.log").read_text()
    with open(tmp_path / "gpu-check" / "status.csv") as f:
        assert [row["status"] for row in csv.DictReader(f)] == ["skipped", "skipped", "ok"]


def test_the_budget_cuts_a_part_s_timeout(tmp_path):
    parts = [Part("sleeper", py("import time; time.sleep(30)"), timeout_s=60, min_s=1)]
    start = time.monotonic()
    outcomes, printed = run(parts, budget_s=2, out_dir=tmp_path, reserve_s=0, kill_grace_s=0.5)
    assert time.monotonic() - start < 10
    assert outcomes[0].status == "timed out"
    assert "cut from 60 s by the budget" in printed


def test_a_failing_or_hanging_part_does_not_stop_the_next(tmp_path):
    parts = [
        Part("hangs", py("import time; print('started', flush=True); time.sleep(5)"), timeout_s=1),
        Part("fails", py("import sys; print('boom', file=sys.stderr); sys.exit(3)"), timeout_s=10),
        Part("works", py("print('fine')"), timeout_s=10),
    ]
    start = time.monotonic()
    outcomes, printed = run(parts, budget_s=60, out_dir=tmp_path, kill_grace_s=0.5)
    assert time.monotonic() - start < 5  # the sleeper was stopped, not waited for
    assert [o.label for o in outcomes] == ["timed out", "failed rc=3", "ok"]
    logs = tmp_path / "gpu-check"
    hung = (logs / "hangs.log").read_text()
    assert "started" in hung and "timed out" in hung  # what it printed before it was stopped is kept
    assert "boom" in (logs / "fails.log").read_text()
    assert "| boom" in printed  # the tail of a failed part is printed
    table = "\n".join(gpu_check.status_table(outcomes))
    assert "timed out" in table and "failed rc=3" in table


def test_a_bench_part_prints_the_rows_it_appended(tmp_path):
    fields = ["run_id", "benchmark", "sweep", "case", "op", "mode", "dtype", "params", "provider", "variant",
              "status", "median_ms", "speedup_vs_torch", "error"]
    csv_path = tmp_path / "some-gpu.csv"

    def row(provider, status, median, speedup, params="B=1 L=1024", error=""):
        return ["r", "attention", "sweep", "", "attention", "fwd", "float16", params, provider, "", status, median,
                speedup, error]

    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        w.writerow(row("torch", "ok", "9.0", "", params="B=9 OLD"))  # an earlier run's row
    new = [row("torch", "ok", "2.0", ""), row("fasttrans-triton", "ok", "1.0", "2.0"),
           row("fasttrans-extension", "error", "", "", error="RuntimeError: bad")]
    code = (f"import csv; f = open({str(csv_path)!r}, 'a', newline=''); w = csv.writer(f); "
            f"[w.writerow(r) for r in {new!r}]; f.write('cut,sho'); f.close()")  # a row cut short by a kill
    outcomes, printed = run([Part("bench", py(code), timeout_s=10, bench=True)], 60, tmp_path)
    assert outcomes[0].rows == 3 and outcomes[0].row_errors == 1
    assert "OLD" not in printed
    line = next(line for line in printed.splitlines() if line.startswith("  attention fwd fp16 B=1 L=1024"))
    assert "2.000" in line and "1.000 (2.00x)" in line and "error" in line
    header = next(line for line in printed.splitlines() if "configuration" in line)
    assert header.index("torch") < header.index("fasttrans-triton")  # the baseline first
    assert "ERROR fasttrans-extension" in printed and "RuntimeError: bad" in printed
