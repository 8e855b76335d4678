"""``python -m fasttrans compile-check``: every Triton kernel and shipped launch configuration.

The full check compiles every target of kernels/attention.py and kernels/layernorm.py for
sm_80 and sm_90 (no GPU needed) and requires zero register spills, shared memory within the
architecture's limit and tensor-core matmuls (mma.sync / wgmma). It is the slowest test here:
a first run compiles every build (minutes on two cores); later runs read Triton's cached
binaries. The other tests check that the tool can fail: a spilling configuration, a matmul
that misses the tensor cores, a module without compile_targets, a module that does not exist.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from fasttrans import compile_check

ARCHS = ["sm_80", "sm_90"]
ATTENTION_KERNELS = {"attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq", "attention_dropout_mask",
                     "attention_tile_map", "attention_tile_lists"}
ATTENTION_MATMUL_KERNELS = {"attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq"}


def _describe(rows):
    return "\n".join(f"{r['kernel']} [{r['config']}] {r['arch']}: {r['error']}" for r in rows)


@pytest.fixture(scope="module")
def all_rows():
    start = time.perf_counter()
    rows = compile_check.run(ARCHS, jobs=2)
    print(f"\ncompile-check: {len(rows)} builds in {time.perf_counter() - start:.0f} s")
    return rows


@pytest.mark.slow(minutes=3)  # a first run compiles every build; the module's rows are shared
def test_every_shipped_configuration_compiles_without_spills(all_rows):
    failed = [r for r in all_rows if not r["ok"]]
    assert not failed, "compile-check failures:\n" + _describe(failed)


@pytest.mark.slow
def test_attention_builds_cover_every_kernel_on_both_archs(all_rows):
    rows = [r for r in all_rows if r["kernel"].startswith("attention")]
    for arch in ARCHS:
        assert {r["kernel"] for r in rows if r["arch"] == arch} == ATTENTION_KERNELS, arch
        # each matmul kernel: every (head-dim class, weight) has a configuration for each arch
        for kernel in ATTENTION_MATMUL_KERNELS:
            classes = {tuple(r["config"].split("-")[:2]) for r in rows if r["kernel"] == kernel and r["arch"] == arch}
            assert classes >= {(f"d{d}", w) for d in (64, 128, 256) for w in ("light", "heavy")}, (kernel, arch)
    for r in rows:
        assert r["spills"] == 0 and r["registers"] is not None and 0 < r["registers"] <= 255, r
        assert 0 <= r["shared_bytes"] <= compile_check.SHARED_LIMIT[compile_check.ARCHS[r["arch"]]], r
        # fp32 classes in FP32_IEEE_CLASSES run IEEE fp32 on FMA units by design; every other matmul build
        # (16-bit, fp32 as 3xTF32 or TF32) must use tensor cores
        if r["kernel"] in ATTENTION_MATMUL_KERNELS and "-fp32-ieee" not in r["config"]:
            assert r["tensor_cores"] is True, f"{r['kernel']} [{r['config']}] {r['arch']}: no tensor cores"
    # every fp32 class, in both archs, is built
    for arch in ARCHS:
        for kernel in ATTENTION_MATMUL_KERNELS:
            fp32 = {tuple(r["config"].split("-")[:2]) for r in rows
                    if r["kernel"] == kernel and r["arch"] == arch and "-fp32" in r["config"]}
            assert fp32 == {(f"d{d}", w) for d in (64, 128, 256) for w in ("light", "heavy")}, (kernel, arch)
            # capped scores (SOFTCAP) in every entry a capped launch takes: the dropout weight and heavier
            capped = {tuple(r["config"].split("-")[:2]) for r in rows
                      if r["kernel"] == kernel and r["arch"] == arch and r["config"].endswith("-softcap")}
            assert capped >= {(f"d{d}", "heavy") for d in (64, 128, 256)}, (kernel, arch)
            assert not any(w == "light" for _, w in capped), (kernel, arch)


def test_json_output_has_the_documented_keys(capsys):
    status = compile_check.main(["--json", "--module", "attention", "--kernel", "attention_dropout_mask",
                                 "--arch", "sm_80", "--jobs", "1"])
    rows = json.loads(capsys.readouterr().out)
    assert status == 0, rows
    assert len(rows) == 1
    assert set(rows[0]) == {"kernel", "config", "arch", "ok", "registers", "spills", "shared_bytes", "tensor_cores",
                            "tma", "wgmma_shapes", "loop_per_element", "partial_loop_per_element", "error"}
    assert rows[0]["kernel"] == "attention_dropout_mask" and rows[0]["arch"] == "sm_80" and rows[0]["ok"]


def test_rejects_an_unknown_arch():
    with pytest.raises(SystemExit) as e:
        compile_check.main(["--arch", "sm_70"])
    assert e.value.code == 2


def test_counts_are_those_of_the_binary_triton_built(tmp_path):
    """Registers and stack frame come from the binary Triton's own ptxas run built, with the
    options that run adds: they match the log that run prints (a fresh cache compiles)."""
    # a tile far too large for the registers: a nonzero stack frame to compare too
    code = ("import json; from fasttrans import compile_check as c; from fasttrans.kernels import attention as a; "
            "from fasttrans.kernels._attention_configs import _cfg; "
            "from fasttrans.kernels._attention_targets import _compile_target; "
            "t = _compile_target(a._attention_fwd_kernel, 'oversized_fwd', _cfg(256, 64, 4, 1), 128, 'light'); "
            "print(json.dumps(c._build('attention', t, 'sm_90')))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, as the workers do
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DUMP_PTXAS_LOG="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    log = proc.stdout
    assert row["registers"] == int(re.search(r"Used (\d+) registers", log).group(1)), (row, log)
    assert row["spills"] == int(re.search(r"(\d+) bytes stack frame", log).group(1)) > 0, (row, log)


@pytest.fixture
def fake_kernels(tmp_path, monkeypatch):
    """A package of kernels modules the workers can import: one broken in each way."""
    pkg = tmp_path / "fake_kernels_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "no_targets.py").write_text("X = 1\n")
    (pkg / "bad.py").write_text(textwrap.dedent('''
        import torch
        from fasttrans.kernels import attention as A
        from fasttrans.kernels._attention_configs import _cfg
        from fasttrans.kernels._attention_targets import _compile_target


        def compile_targets():
            # a tile far too large for the registers (and shared memory) of one block
            spills = _compile_target(A._attention_fwd_kernel, "oversized_fwd", _cfg(256, 64, 4, 1), 128, "light")
            # fp32 operands with IEEE precision: the matmuls run on FMA units, not tensor cores
            fma = _compile_target(A._attention_fwd_kernel, "fp32_fwd", _cfg(32, 32, 4, 1), 64, "light")
            for name in ("Q", "K", "V", "Out", "Mask"):
                fma["signature"][name] = "*fp32"
            # a loop goal no kernel meets
            slow = _compile_target(A._attention_fwd_kernel, "slow_loop_fwd", _cfg(128, 128, 8, 3), 64, "light")
            slow.update(loop_scores=128 * 128, loop_goal=1.0)
            # a loop goal on a kernel whose loop issues no tensor-core instruction
            no_loop = _compile_target(A._attention_fwd_kernel, "fma_loop_fwd", _cfg(32, 32, 4, 1), 64, "light")
            for name in ("Q", "K", "V", "Out", "Mask"):
                no_loop["signature"][name] = "*fp32"
            no_loop.update(matmul=False, loop_scores=32 * 32, loop_goal=100.0)
            return [spills, fma, slow, no_loop]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fake_kernels_pkg"


def test_reports_spills_missing_tensor_cores_and_broken_modules(fake_kernels):
    rows = compile_check.run(["sm_80"], jobs=1, modules=["no_such_kernels", f"{fake_kernels}.no_targets",
                                                        f"{fake_kernels}.bad"])
    by_kernel = {r["kernel"]: r for r in rows}
    assert "module not found" in by_kernel["kernels/no_such_kernels.py"]["error"]
    assert "compile_targets" in by_kernel[f"{fake_kernels}.no_targets"]["error"]
    oversized = by_kernel["oversized_fwd"]
    assert not oversized["ok"] and oversized["spills"] > 0, oversized
    fma = by_kernel["fp32_fwd"]
    assert not fma["ok"] and fma["tensor_cores"] is False and "mma.sync" in fma["error"], fma
    # loop goals hold on sm_90 only
    for name in ("slow_loop_fwd", "fma_loop_fwd"):
        assert by_kernel[name]["ok"], by_kernel[name]
    assert by_kernel["slow_loop_fwd"]["loop_per_element"] > 1.0
    assert all(not r["ok"] for r in rows if not r["kernel"].endswith("_loop_fwd"))


def test_reports_loops_over_their_goal(fake_kernels):
    rows = compile_check.run(["sm_90"], jobs=1, modules=[f"{fake_kernels}.bad"], kernel="loop_fwd")
    by_kernel = {r["kernel"]: r for r in rows}
    slow = by_kernel["slow_loop_fwd"]
    assert not slow["ok"] and slow["spills"] == 0 and slow["tensor_cores"], slow
    assert slow["loop_per_element"] > 1.0 and "SASS instructions per score element > 1.0" in slow["error"], slow
    assert "m64n128k16" in slow["wgmma_shapes"] and slow["tma"] is False, slow
    no_loop = by_kernel["fma_loop_fwd"]
    assert not no_loop["ok"] and no_loop["loop_per_element"] is None and "no main loop" in no_loop["error"], no_loop


SASS = """
Function:kernel
--:-:-:-:1	MOV R1, R2;
LBB0:
--:-:-:-:1	FADD R1, R1, R2;
LBB1:
--:-:-:-:1	HMMA.16816.F32 R4, R8, R12, R4;
--:-:-:-:1	FMUL R1, R1, R1;
--:-:-:-:5	@P0 BRA LBB1;
--:-:-:-:1	IADD3 R3, R3, 0x1, RZ;
--:-:-:-:5	@P1 BRA LBB0;
--:-:-:-:1	@!P2 BRA LBB3;
--:-:-:-:1	EXIT;
LBB2:
--:-:-:-:1	FADD R1, R1, R2;
--:-:-:-:5	@P0 BRA LBB2;
LBB3:
--:-:-:-:1	FADD R1, R1, R2;
--:-:-:-:1	@!UP0 HGMMA.64x64x16.F32 R24, gdesc[UR28], RZ, !UPT;
--:-:-:-:5	@P0 BRA LBB3;
"""


def test_sass_loops_are_the_innermost_backward_branches():
    loops = compile_check.sass_loops(SASS)
    # the outer LBB0 loop encloses LBB1's; a forward branch (to LBB3 at first) is no loop
    assert [len(loop) for loop in loops] == [3, 2, 3]
    assert loops[0][0].startswith("HMMA") and loops[0][-1] == "@P0 BRA LBB1"
    assert compile_check.main_loop(SASS) == loops[0]
    assert compile_check.main_loop(SASS.replace("HMMA.16816.F32", "FFMA")) == loops[2]  # a predicated HGMMA
    assert compile_check.main_loop(SASS.replace("HMMA.16816.F32", "FFMA").replace("HGMMA.64x64x16.F32", "FFMA")) \
        is None
    # more tensor-core instructions win over program order; of equals, the shorter loop (the
    # one over full tiles, without the masked copy's per-element selects)
    heavier = SASS.replace("--:-:-:-:5	@P0 BRA LBB3;", "--:-:-:-:1	HGMMA.64x64x16.F32 R24, gdesc[UR28], RZ, !UPT;\n"
                           "--:-:-:-:5	@P0 BRA LBB3;")
    assert compile_check.main_loop(heavier) == compile_check.sass_loops(heavier)[2]
    longer_first = SASS.replace("--:-:-:-:1	FMUL R1, R1, R1;", "--:-:-:-:1	FMUL R1, R1, R1;\n--:-:-:-:1	FSEL R1, R1, RZ, !P1;")
    assert compile_check.main_loop(longer_first) == compile_check.sass_loops(longer_first)[2]


@pytest.mark.slow
def test_loop_goals_hold_for_every_entry_they_name(all_rows):
    from fasttrans.kernels import _attention_configs as configs
    from fasttrans.kernels._attention_targets import LOOP_GOALS

    # every sm_90 entry of a class with a goal is built in fp16 and bf16 and meets it; the
    # goals are counts of Triton 3.9's SASS, and an older Triton's loops are only reported
    held = configs.TRITON_VERSION >= (3, 9)
    tables = {"attention_fwd": configs.FWD_CONFIGS, "attention_bwd_dkdv": configs.BWD_DKDV_CONFIGS,
              "attention_bwd_dq": configs.BWD_DQ_CONFIGS}
    assert LOOP_GOALS
    for (kernel, dclass, weight), goal in LOOP_GOALS.items():
        table = tables[kernel]["sm_90"][(dclass, weight)]
        for dtype in ("", "-bf16"):  # fp16 and bf16, every entry of the class
            for cfg in table:
                name = f"d{dclass}-{weight}-m{cfg.kwargs['BLOCK_M']}-n{cfg.kwargs['BLOCK_N']}-w{cfg.num_warps}" \
                       f"s{cfg.num_stages}{dtype}"
                row = next(r for r in all_rows if r["kernel"] == kernel and r["arch"] == "sm_90" and r["config"] == name)
                assert row["ok"] and row["loop_per_element"] is not None, row
                assert not held or row["loop_per_element"] <= goal, row


@pytest.mark.slow
def test_dropout_at_most_doubles_the_forward_loop(all_rows):
    """One Philox call per eight scores, drawn in the accumulator's own layout (no trip
    through shared memory): the forward with dropout alone runs its loop in at most twice
    the instructions of the same build without it (sm_90, the goal held on Triton 3.9)."""
    from fasttrans.kernels._attention_configs import TRITON_VERSION

    if TRITON_VERSION < (3, 9):
        pytest.skip("the loop goals are counts of Triton 3.9's SASS")
    fwd = {r["config"]: r for r in all_rows if r["kernel"] == "attention_fwd" and r["arch"] == "sm_90"}
    for dclass in (64, 128):
        (plain,) = [r for c, r in fwd.items() if c.startswith(f"d{dclass}-heavy") and c.endswith("-plain")]
        (dropout,) = [r for c, r in fwd.items() if c.startswith(f"d{dclass}-heavy") and c.endswith("-dropout")]
        assert dropout["loop_per_element"] <= 2 * plain["loop_per_element"], (dropout, plain)


@pytest.mark.slow
def test_a_dense_masks_full_tiles_run_the_unmasked_loop(all_rows):
    """The forward with a dense bool mask alone runs its listed full tiles in a loop within 5%
    of the same build without a mask (it carries its list's next entries; 10% under Triton 3.8,
    which schedules the d64 loop without a mask 7% shorter than its full-tile loop),
    and its partial tiles, which test a bit of the mask per score, within 1.3 times (the goal
    held on Triton 3.9); the dQ kernel with a mask has both loops too."""
    from fasttrans.kernels._attention_configs import TRITON_VERSION

    full_tiles = 1.1 if TRITON_VERSION == (3, 8) else 1.05
    fwd = {r["config"]: r for r in all_rows if r["kernel"] == "attention_fwd" and r["arch"] == "sm_90"}
    for dclass in (64, 128):
        (plain,) = [r for c, r in fwd.items() if c.startswith(f"d{dclass}-heavy") and c.endswith("-plain")]
        (bool_,) = [r for c, r in fwd.items() if c.startswith(f"d{dclass}-heavy") and c.endswith("-bool")]
        assert plain["partial_loop_per_element"] is None, plain
        assert bool_["loop_per_element"] <= full_tiles * plain["loop_per_element"], (bool_, plain)
        assert bool_["partial_loop_per_element"] > bool_["loop_per_element"], bool_
        if TRITON_VERSION >= (3, 9):
            assert bool_["partial_loop_per_element"] <= 1.3 * plain["loop_per_element"], (bool_, plain)
    dq = [r for r in all_rows if r["kernel"] == "attention_bwd_dq" and r["arch"] == "sm_90" and "-heavy-" in r["config"]
          and not r["config"].startswith("d256") and "ieee" not in r["config"]]
    assert dq and all(r["partial_loop_per_element"] is not None for r in dq), _describe(dq)
