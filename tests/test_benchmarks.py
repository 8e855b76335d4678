"""The benchmark scripts: their --quick mode end to end, and the measuring machinery they share.

The end-to-end tests run each script as `make bench-quick` does, into a temporary results
directory, with one torch thread (a smoke run on a shared machine, not a measurement), and
check the CSV and PNGs: every provider row has a status, numbers only where the status is
ok, and sane numbers there.
"""

import csv
import itertools
import math
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # `benchmarks` is a directory of scripts; last: see conftest.py

from benchmarks import common  # noqa: E402

SCRIPTS = {"attention": "bench_attention.py", "layernorm": "bench_layernorm.py", "dropout": "bench_dropout.py",
           "model": "bench_model.py"}
NUMERIC = ("median_ms", "q20_ms", "q80_ms", "samples", "throughput", "speedup_vs_torch", "peak_mem_bytes",
           "mem_vs_torch")


# --------------------------------------------------------------------------------------
# shared machinery
# --------------------------------------------------------------------------------------
def test_quantiles_match_numpys_linear_rule():
    np = pytest.importorskip("numpy")
    samples = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 7.0]
    t = common.Timing(samples)
    for q in (0.0, 0.2, 0.5, 0.8, 1.0):
        assert t.quantile(q) == pytest.approx(float(np.quantile(samples, q)))
    assert t.median == 4.0


def test_cpu_peak_memory_sees_torch_allocations():
    mib = 2**20

    def alloc():
        a = torch.empty(3 * mib, dtype=torch.uint8)  # 3 MiB
        b = torch.empty(5 * mib, dtype=torch.uint8)  # 5 MiB: 8 MiB live
        del a  # 5 MiB live
        c = torch.empty(2 * mib, dtype=torch.uint8)  # 7 MiB live
        return b, c

    peak = common.peak_memory_bytes(alloc, "cpu")
    assert 8 * mib <= peak < 8 * mib + 64 * 1024, peak


def test_cpu_peak_memory_excludes_what_was_live_before():
    x = torch.empty(16 * 2**20, dtype=torch.uint8)
    peak = common.peak_memory_bytes(lambda: x + 1, "cpu")  # one output of x's size
    assert x.numel() <= peak < x.numel() + 64 * 1024, peak


def _recorder(calls: list, name: str):
    """A function to time that appends ``name`` to ``calls`` each time it is called."""
    return lambda: calls.append(name)


def _plan(block_s: float, rounds: int) -> common.TimingPlan:
    """Exactly ``rounds`` rounds with no warm-up time and no time limits."""
    return common.TimingPlan(warmup_s=0.0, block_s=block_s, min_rounds=rounds, max_rounds=rounds, min_time_s=0.0,
                             max_time_s=0.0, cuda_warmup_ms=1, cuda_rep_ms=1)


def test_interleaved_timing_alternates_providers_and_keeps_failures_apart():
    calls = []

    def broken():
        raise ValueError("no kernel for this shape")

    fns = {"a": _recorder(calls, "a"), "b": _recorder(calls, "b"), "broken": broken}
    out = common.measure_interleaved(fns, "cpu", _plan(block_s=0.0, rounds=4))
    assert isinstance(out["broken"], ValueError)
    assert len(out["a"].samples) == len(out["b"].samples) == 4
    # block_s=0 gives blocks of one call, each preceded by Timer's two warm-up calls
    blocks = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert all(len(set(b)) == 1 and len(b) == 3 for b in blocks), calls
    timed = [b[0] for b in blocks][2:]  # after each provider's block-size probe
    assert sorted(timed[i] + timed[i + 1] for i in range(0, 8, 2)) == ["ab", "ab", "ba", "ba"]


def test_cold_timing_flushes_the_caches_before_every_timed_call():
    calls = []
    fns = {"a": _recorder(calls, "a"), "b": _recorder(calls, "b")}
    out = common.measure_interleaved(fns, "cpu", _plan(block_s=1e-4, rounds=3), flush=_recorder(calls, "flush"))
    assert len(out["a"].samples) == len(out["b"].samples) == 3
    assert calls[:2] == ["flush", "flush"]  # the flush's own timing, which sizes the blocks
    timed = calls[calls.index("b") + 1:]
    while timed[0] != "flush":  # the end of b's warm-up (Timer's calls, which are never samples)
        timed = timed[1:]
    assert timed and all(timed[i] == "flush" and timed[i + 1] in "ab" for i in range(0, len(timed), 2)), timed
    # each provider's block size is measured, so a and b may differ; each keeps its own in every
    # round, and the rotation gives the runs a | b b | a a | b
    runs = [(k, len(list(g))) for k, g in itertools.groupby(c for c in timed if c != "flush")]
    assert [k for k, _ in runs] == ["a", "b", "a", "b"], runs
    a_block, b_block = runs[0][1], runs[-1][1]
    assert [n for _, n in runs] == [a_block, 2 * b_block, 2 * a_block, b_block], runs


def test_last_level_cache_size_comes_from_sysfs(tmp_path):
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "32768K\n")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size)
    assert common.last_level_cache_bytes(tmp_path) == 32 * 2**20
    assert common.last_level_cache_bytes(tmp_path / "absent") is None
    flush = common.CacheFlush(cache_bytes=2**20)
    assert flush.buffer.numel() * flush.buffer.element_size() == flush.nbytes == 2 * 2**20
    flush()


def test_cold_run_flushes_and_marks_its_rows(tmp_path, monkeypatch):
    flushes = []
    monkeypatch.setattr(common.CacheFlush, "__call__", lambda self: flushes.append(self.nbytes))
    bench = _bench(tmp_path, "--quick", "--cache", "cold")
    cfg = common.Config(sweep="sweep", op="add", mode="fwd", dtype=torch.float32, params={},
                        inputs=lambda: torch.ones(3), entries=[
                            common.Entry(common.Provider("torch"), lambda x: (lambda: x + 1))])
    (row,) = bench.run(cfg)
    assert row.status == "ok" and len(row.timing.samples) >= 3
    assert len(flushes) >= 2 + len(row.timing.samples)  # at least one before each sample's call
    assert {r["cache"] for r in _read_csv(bench.csv_path)} == {"cold"}
    warm = _bench(tmp_path / "warm", "--quick")
    warm.run(cfg)
    assert {r["cache"] for r in _read_csv(warm.csv_path)} == {"warm"}


def test_rows_say_which_allocator_setting_they_ran_with(tmp_path, monkeypatch):
    """A plain process is the default; ``--malloc steady`` is asked for and marked."""
    applied = []
    monkeypatch.setattr(common, "steady_allocator", lambda: applied.append(True) or True)
    cfg = common.Config(sweep="sweep", op="add", mode="fwd", dtype=torch.float32, params={},
                        inputs=lambda: torch.ones(3), entries=[
                            common.Entry(common.Provider("torch"), lambda x: (lambda: x + 1))])
    plain = _bench(tmp_path / "plain", "--quick")
    plain.run(cfg)
    assert applied == [] and {r["malloc"] for r in _read_csv(plain.csv_path)} == {"default"}
    steady = _bench(tmp_path / "steady", "--quick", "--malloc", "steady")
    steady.run(cfg)
    assert applied == [True] and {r["malloc"] for r in _read_csv(steady.csv_path)} == {"steady"}


def test_cuda_timing_is_always_cold(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        common.parse_args(common.make_parser("test"), ["--device", "cuda", "--cache", "warm"])
    assert "--cache warm" in capsys.readouterr().err
    assert common.parse_args(common.make_parser("test"), ["--device", "cuda"]).cache == "cold"


def test_provider_filter():
    sel = common.provider_selected
    assert sel("fasttrans-extension", [])
    assert sel("fasttrans-extension", ["fasttrans"])
    assert not sel("torch", ["fasttrans"])
    assert sel("torch-compile", ["torch"])
    assert not sel("fasttrans-triton", ["fasttrans-reference"])
    assert sel("fasttrans-triton", ["*triton"])


def test_every_backend_is_a_provider_and_unavailable_ones_say_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # Triton's interpreter is never timed
    providers = common.fasttrans_providers("cpu", "attention")
    from fasttrans import backends

    assert [p.name for p in providers] == [f"fasttrans-{n}" for n in backends.BACKENDS]
    for p in providers:
        assert p.unavailable is None or p.unavailable.strip(), p
    assert next(p for p in providers if p.backend == "reference").unavailable is None


def _bench(tmp_path, *argv):
    parser = common.make_parser("test")
    args = common.parse_args(parser, ["--device", "cpu", "--out-dir", str(tmp_path), *argv])
    return common.Bench("unit", args)


def test_failing_provider_is_an_error_row_with_no_numbers(tmp_path):
    bench = _bench(tmp_path, "--quick")

    def broken(_inputs):
        def run():
            raise RuntimeError("kernel exploded")
        return run

    cfg = common.Config(
        sweep="sweep", op="add", mode="fwd", dtype=torch.float32, params={"N": 7},
        inputs=lambda: torch.ones(7), work=7.0, work_unit="B", measure="time+memory",
        entries=[
            common.Entry(common.Provider("torch"), lambda x: (lambda: x + 1)),
            common.Entry(common.Provider("fasttrans-broken", backend="broken"), broken),
            common.Entry(common.Provider("fasttrans-absent", backend="absent", unavailable="not built"), broken),
            common.Entry(common.Provider("fasttrans-slow", backend="slow"), broken, skip="too big"),
        ],
    )
    bench.run(cfg)
    assert bench.finish() == 1
    rows = {r["provider"]: r for r in _read_csv(bench.csv_path)}
    assert rows["torch"]["status"] == "ok" and float(rows["torch"]["median_ms"]) > 0
    assert rows["torch"]["speedup_vs_torch"] == "1.0000"
    assert rows["fasttrans-broken"]["status"] == "error"
    assert "kernel exploded" in rows["fasttrans-broken"]["error"]
    assert rows["fasttrans-absent"]["status"] == "unavailable" and rows["fasttrans-absent"]["error"] == "not built"
    assert rows["fasttrans-slow"]["status"] == "skipped" and rows["fasttrans-slow"]["error"] == "too big"
    for name in ("fasttrans-broken", "fasttrans-absent", "fasttrans-slow"):
        assert all(rows[name][k] == "" for k in NUMERIC), rows[name]


def test_csv_with_other_columns_is_not_appended_to(tmp_path):
    bench = _bench(tmp_path, "--quick")
    bench.csv_path.write_text("date,provider,median_ms\n2020-01-01,torch,1.0\n")
    cfg = common.Config(sweep="sweep", op="add", mode="fwd", dtype=torch.float32, params={},
                        inputs=lambda: torch.ones(3), entries=[
                            common.Entry(common.Provider("torch"), lambda x: (lambda: x + 1))])
    with pytest.raises(SystemExit, match="other columns"):
        bench.run(cfg)
    assert bench.csv_path.read_text() == "date,provider,median_ms\n2020-01-01,torch,1.0\n"


def test_model_benchmark_refuses_to_run_on_placeholder_modules(tmp_path, monkeypatch, capsys):
    import fasttrans
    from benchmarks import bench_model

    monkeypatch.setattr(fasttrans.nn, "Transformer", None)
    assert bench_model.main(["--quick", "--device", "cpu", "--out-dir", str(tmp_path)]) == 2
    assert "fasttrans.nn.Transformer is still a placeholder" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _listed(capsys, module, *argv) -> list[str]:
    """The configuration lines `--list` prints (nothing is run or written)."""
    assert module.main(["--list", "--device", "cpu", *argv]) == 0
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]


def test_goal_configurations_are_in_the_default_cpu_sweep(capsys):
    from benchmarks import bench_attention, bench_dropout, bench_layernorm, bench_model

    lines = _listed(capsys, bench_attention)
    for mask in ("key_padding", "causal"):
        for mode in ("fwd", "fwd+bwd"):
            goal = f"] attention {mode} float32 B=4 H=8 Lq=1024 Lk=1024 D=64 mask={mask}"
            assert any(line.startswith("[attention headline") and line.endswith(goal) for line in lines), goal
    assert any(line.endswith("] multihead_attention fwd+bwd float32 B=4 L=512 E=512 H=8 mask=key_padding")
               for line in lines)
    memory = "] attention fwd+bwd float32 B=1 H=8 Lq=8192 Lk=8192 D=64 mask=none"
    assert any(line.startswith("[attention memory") and line.endswith(memory) for line in lines)
    sweep = [line for line in lines if line.startswith("[attention sweep]")]
    assert {int(line.split("Lq=")[1].split()[0]) for line in sweep} == {128, 256, 512, 1024, 2048}
    assert {line.split("D=")[1].split()[0] for line in sweep} == {"64", "128"}
    assert {line.split("mask=")[1] for line in sweep} == set(bench_attention.MASKS)
    short = {line.split("] ", 1)[1] for line in lines if line.startswith("[attention short ")}
    assert short >= {  # the seq2seq model's attention in training, and incremental decoding
        "attention fwd+bwd float32 B=64 H=4 Lq=91 Lk=91 D=64 mask=key_padding",
        "attention fwd+bwd float32 B=64 H=4 Lq=9 Lk=9 D=64 mask=causal",
        "attention fwd+bwd float32 B=64 H=4 Lq=9 Lk=91 D=64 mask=key_padding",
        "attention fwd float32 B=4 H=8 Lq=1 Lk=1024 D=64 mask=none",
    }, short

    lines = _listed(capsys, bench_layernorm)
    assert any(line.endswith("] layer_norm fwd float32 M=4096 N=1024") for line in lines)
    assert any(line.endswith("] add_layer_norm fwd+bwd float32 M=4096 N=1024") for line in lines)

    lines = _listed(capsys, bench_dropout)
    for mode in ("fwd", "fwd+bwd"):  # the FFN hidden activation of the training step: 64 x 91 tokens, FFN 512
        goal = f"] dropout {mode} float32 M=5824 N=512 elements=2981888 p=0.1"
        assert any(line.startswith("[dropout headline") and line.endswith(goal) for line in lines), goal
    sweep = [line for line in lines if line.startswith("[dropout sweep]")]
    assert {int(line.split("elements=")[1].split()[0]) for line in sweep} == {4**k for k in range(8, 13)}
    assert all(" N=1024 " in line for line in sweep), sweep

    lines = _listed(capsys, bench_model)
    assert any(line.startswith("[model headline") and line.endswith(
        "] seq2seq train step float32 model=digits d_model=256 heads=4 layers=3+3 ffn=512 batch=64 src=91 tgt=9")
        for line in lines), lines
    infer = [line.split("batch=")[1] for line in lines if line.startswith("[model infer")]
    assert infer == ["1 src=8 tgt=4", "1 src=32 tgt=9", "1 src=91 tgt=9", "8 src=91 tgt=9", "64 src=91 tgt=9"]


def test_filters_select_configurations_in_every_sweep(capsys):
    from benchmarks import bench_attention, bench_dropout, bench_layernorm

    lines = _listed(capsys, bench_attention, "--mask", "causal", "--mode", "fwd", "--seq-len", "256,1024")
    assert lines
    assert all(line.endswith("mask=causal") and "] attention fwd float32" in line for line in lines), lines
    assert {line.split("Lq=")[1].split()[0] for line in lines} == {"256", "1024"}
    lines = _listed(capsys, bench_layernorm, "--op", "rms_norm", "--hidden", "4096")
    assert lines and all("] rms_norm " in line and line.endswith("N=4096") for line in lines), lines
    with pytest.raises(SystemExit, match="--op"):
        bench_layernorm.main(["--list", "--op", "layernorm"])
    lines = _listed(capsys, bench_dropout, "--mode", "fwd", "--p", "0.3")
    assert lines and all("] dropout fwd float32" in line and line.endswith("p=0.3") for line in lines), lines
    with pytest.raises(SystemExit):
        bench_dropout.main(["--list", "--p", "1.5"])


def test_dropout_bytes_count_x_y_and_the_one_byte_mask():
    from benchmarks import bench_dropout

    n = 64 * 1024
    assert bench_dropout.dropout_bytes(64, 1024, torch.float32, "fwd") == 2 * n * 4 + n
    assert bench_dropout.dropout_bytes(64, 1024, torch.float32, "fwd+bwd") == 4 * n * 4 + 2 * n
    assert bench_dropout.dropout_bytes(64, 1024, torch.float16, "fwd+bwd") == 4 * n * 2 + 2 * n


def test_device_slug_is_a_file_name():
    assert common.slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert common.slugify("AMD EPYC 2 cores") == "amd-epyc-2-cores"


def test_cpus_without_avx512_are_named_apart(tmp_path):
    """One model name ("AMD EPYC") covers AVX2-only and AVX-512 CPUs: the former get " AVX2"."""
    cpuinfo = tmp_path / "cpuinfo"
    for flags, suffix in (("fpu sse2 avx avx2 fma", " AVX2"), ("fpu avx2 fma avx512f avx512bw", ""), ("fpu sse2", "")):
        cpuinfo.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n")
        assert common._cpu_vector_suffix(str(cpuinfo)) == suffix, flags
    assert common._cpu_vector_suffix(str(tmp_path / "absent")) == ""


# --------------------------------------------------------------------------------------
# the scripts, end to end
# --------------------------------------------------------------------------------------
def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == common.FIELDS
        return list(reader)


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    """Run every script's --quick mode once into one results directory."""
    out = tmp_path_factory.mktemp("results")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as `make bench-quick` runs
    runs = {}
    for name, script in SCRIPTS.items():
        proc = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / script), "--quick", "--device", "cpu", "--threads", "1",
             "--out-dir", str(out)],
            capture_output=True, text=True, env=env, timeout=600,
        )
        runs[name] = proc
    return out, runs


@pytest.mark.slow(minutes=1.5)
# (not named "benchmark": pytest-benchmark, where installed, claims that argument name)
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_quick_run_writes_sane_rows_and_plots(quick_results, script):
    out, runs = quick_results
    proc = runs[script]
    assert proc.returncode == 0, f"{SCRIPTS[script]} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    csvs = list(out.glob("*.csv"))
    assert len(csvs) == 1, csvs  # one file per device, every script appends to it
    rows = [r for r in _read_csv(csvs[0]) if r["benchmark"] == script]
    assert rows
    for r in rows:
        for k in NUMERIC:  # empty or a finite number: never NaN or inf standing in for a failure
            assert r[k] == "" or math.isfinite(float(r[k])), (k, r)
        assert r["run"] == "quick" and r["cache"] == "warm" and r["device"] == "cpu"
        assert r["torch"] == torch.__version__
        assert r["date"] and r["device_name"] and r["fasttrans"] and r["triton"]
        assert r["status"] in common.STATUSES, r
        if r["status"] != "ok":
            assert r["error"].strip(), r  # the reason is always given ...
            assert all(r[k] == "" for k in NUMERIC), r  # ... and never a number
            continue
        if r["median_ms"]:
            q20, med, q80 = (float(r[k]) for k in ("q20_ms", "median_ms", "q80_ms"))
            assert 0 < q20 <= med <= q80 and math.isfinite(q80), r
            assert int(r["samples"]) >= 3
            assert float(r["throughput"]) > 0 and r["throughput_unit"], r
        if r["peak_mem_bytes"]:
            assert int(r["peak_mem_bytes"]) > 0
    # every configuration has its torch baseline, timed, and ratios against it
    configs = {(r["sweep"], r["op"], r["mode"], r["params"]) for r in rows}
    for cfg in configs:
        mine = [r for r in rows if (r["sweep"], r["op"], r["mode"], r["params"]) == cfg]
        torch_rows = [r for r in mine if r["provider"] == "torch" and r["status"] == "ok"]
        assert torch_rows, cfg
        for r in mine:
            if r["status"] == "ok" and r["median_ms"]:
                assert float(r["speedup_vs_torch"]) > 0, r
    # every fasttrans backend shows up, available or not
    from fasttrans import backends

    providers = {r["provider"] for r in rows}
    assert {f"fasttrans-{n}" for n in backends.BACKENDS} <= providers
    assert any(r["sweep"] == "headline" for r in rows)
    assert "Headline" in proc.stdout
    pngs = [p for p in out.glob("*.png") if f"_{script}_" in p.name]
    assert pngs, list(out.iterdir())
    for png in pngs:
        assert png.name.endswith("_quick.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_hf_sweep_runs_the_models_in_the_dtype_asked(tmp_path):
    """make gpu-check runs the hf sweep in bf16: the models, their fasttrans copies and the
    rows are in that dtype, and the copy passes its check against the sdpa model; the
    hf-families sweep too, for every family."""
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_model.py"), "--quick", "--sweep", "hf,hf-families",
         "--dtype", "bfloat16",
         "--provider", "fasttrans-extension,torc[h]", "--device", "cpu", "--threads", "1", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    (csv_path,) = tmp_path.glob("*.csv")
    rows = _read_csv(csv_path)
    hf = [r for r in rows if r["sweep"] == "hf"]
    assert {(r["op"], r["provider"], r["variant"]) for r in hf} == {
        (op, provider, variant) for op in ("BertForMaskedLM", "LlamaForCausalLM")
        for provider, variant in (("fasttrans-extension", ""), ("torch", "sdpa"), ("torch", "eager"))
    } | {(op, "fasttrans-extension", "unpad") for op in ("BertForMaskedLM", "LlamaForCausalLM")}
    assert len(hf) == 18  # BERT's two depths 4 + 4, Llama's unpadded and padded steps 3 + 4, generate 3
    # every family the integration is tested on, its fasttrans copy checked against sdpa's logits
    # (gpt-oss's and Gemma 2's against eager's: transformers has no sdpa for sinks and logit caps)
    families = sorted((r["op"], r["provider"], r["variant"]) for r in rows if r["sweep"] == "hf-families")
    assert families == sorted([(f, p, v) for f in ("bert", "bart", "marian", "t5", "gpt2", "llama")
                               for p, v in (("fasttrans-extension", ""), ("torch", "sdpa"))]
                              + [(f, "fasttrans-extension", "unpad") for f in ("bert", "gpt2", "llama")]
                              + [("gpt_oss", "fasttrans-extension", ""), ("gpt_oss", "torch", "eager")] * 2
                              + [("gemma2", "fasttrans-extension", ""), ("gemma2", "torch", "eager")])
    assert {r["mode"] for r in rows if r["op"] == "gpt_oss"} == {"train step", "decode"}
    for r in rows:
        assert r["dtype"] == "bfloat16" and r["status"] == "ok", r


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_steady_allocator_reuses_freed_blocks_instead_of_faulting_them_in_again():
    # A 48 MiB result is above glibc's largest mmap threshold (32 MiB), so by default every
    # call maps it afresh and faults its 12288 pages in again. Two 16 MiB results freed
    # together may or may not trip the moving trim threshold, depending on the heap layout.
    # With steady_allocator() the second and later calls of both reuse the freed blocks.
    # Each call's faults are counted and the median is kept: the kernel's own page scans
    # can fault a block in once in a while, whatever the allocator does.
    script = (
        "import resource, statistics, sys, torch\n"
        "sys.path.insert(0, %r)\n"
        "from benchmarks import common\n"
        "if sys.argv[1] == 'steady':\n"
        "    assert common.steady_allocator()\n"
        "x = torch.randn(3, 4096, 1024)\n"
        "y = x[0]\n"
        "calls = {'one_48_mib': lambda: x + 1, 'two_16_mib': lambda: (y + 1, y + 2)}\n"
        "call = calls[sys.argv[2]]\n"
        "for _ in range(3):\n"
        "    call()\n"
        "faults = []\n"
        "for _ in range(21):\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    call()\n"
        "    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
        "print(statistics.median(faults))\n"
    ) % str(REPO)

    def faults(mode, workload):
        run = subprocess.run([sys.executable, "-c", script, mode, workload], capture_output=True, text=True, check=True)
        return float(run.stdout)

    assert faults("default", "one_48_mib") > 10_000  # the case steady_allocator() is for
    assert faults("steady", "one_48_mib") < 50
    assert faults("steady", "two_16_mib") < 50


def test_train_step_takes_a_compiled_forward():
    # torch.compile's module wrapper raises on len(), so it has no truth value
    from benchmarks import bench_model

    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model)  # lazy: nothing is compiled until a call
    with pytest.raises(TypeError):
        bool(compiled)
    inp = types.SimpleNamespace(src=torch.zeros(2, 4), tgt_in=None, tgt_out=torch.zeros(2, dtype=torch.long))
    assert callable(bench_model.train_step(model, inp, None, forward=compiled))


def test_profile_call_splits_the_host_time_of_each_provider(capsys):
    from benchmarks import profile_call

    assert profile_call.main(["--op", "add_layer_norm", "--shape", "3,64", "--mode", "fwd+bwd", "--calls", "20",
                              "--device", "cpu", "--provider", "fasttrans-extension,fasttrans-triton,torch"]) == 0
    out = capsys.readouterr().out
    sections = dict(part.split("\n", 1) for part in out.split("\n== ")[1:])
    assert set(sections) == {"fasttrans-extension", "fasttrans-triton", "torch"}
    assert "unavailable:" in sections["fasttrans-triton"]  # TRITON_INTERPRET: never timed
    for name in ("fasttrans-extension", "torch"):
        text = sections[name]
        wall = float(text.split("wall")[1].split()[0])
        profiled = float(text.split("profiled")[1].split()[0])
        assert wall > 0 and profiled > 0, text
        assert "C (torch ops, launches, builtins)" in text and "top functions" in text
    assert "  fasttrans\n" in sections["fasttrans-extension"]
    assert "add_layer_norm (functional.py" in sections["fasttrans-extension"]  # the public call's own frame
    assert "  fasttrans\n" not in sections["torch"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="the stand-in CUDA driver is built with a C compiler")
def test_profile_call_times_the_triton_host_path_through_the_stand_in_driver():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for op, shape in (("layer_norm", "2,64"), ("attention", "1,2,5,16")):
        proc = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "profile_call.py"), "--op", op, "--shape", shape, "--mode",
             "fwd+bwd", "--calls", "5", "--device", "cpu", "--standin-driver", "--provider", "fasttrans-triton"],
            capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = proc.stdout
        assert "stand-in driver" in out and "unavailable" not in out, out
        assert float(out.split("wall")[1].split()[0]) > 0
        assert "fasttrans.kernels" in out and "triton" in out  # the launchers' and Triton's own code ran


def test_profile_call_standin_driver_refuses_the_interpreter():
    from benchmarks import profile_call

    assert os.environ.get("TRITON_INTERPRET") == "1"
    with pytest.raises(SystemExit):
        profile_call.main(["--standin-driver", "--device", "cpu", "--calls", "1", "--provider", "torch"])


def test_profile_call_places_code_by_package():
    import triton

    import fasttrans.kernels
    from benchmarks import profile_call

    areas = profile_call._areas()
    assert profile_call.area_of(fasttrans.kernels.layernorm.__file__, areas) == "fasttrans.kernels"
    assert profile_call.area_of(fasttrans.functional.__file__, areas) == "fasttrans"
    assert profile_call.area_of(triton.runtime.jit.__file__, areas) == "triton"
    assert profile_call.area_of(torch.nn.functional.__file__, areas) == "torch (Python)"
    assert profile_call.area_of("~", areas).startswith("C ")
    assert profile_call.area_of(__file__, areas) == "other Python"


def test_profile_call_rejects_a_shape_of_the_wrong_rank():
    from benchmarks import profile_call

    with pytest.raises(SystemExit, match="attention takes B,H,L,D"):
        profile_call.main(["--op", "attention", "--shape", "2,8", "--device", "cpu", "--calls", "1"])


@pytest.mark.slow(minutes=1)
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="the stand-in CUDA driver is built with a C compiler")
def test_host_cost_quick_run_times_the_triton_path_through_the_stand_in_driver(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_host.py"), "--quick", "--device", "cpu", "--threads", "1",
         "--out-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    (csv_path,) = tmp_path.glob("*.csv")
    rows = [r for r in _read_csv(csv_path) if r["benchmark"] == "host"]
    assert {r["sweep"] for r in rows} == {"norms", "attention", "layer", "hf"}
    for cfg in {(r["sweep"], r["op"], r["mode"], r["params"]) for r in rows}:
        mine = {r["provider"]: r for r in rows if (r["sweep"], r["op"], r["mode"], r["params"]) == cfg}
        assert mine["torch"]["status"] == "ok", cfg
        # the stand-in driver makes the Triton path run (and be timed) on a machine without a GPU
        assert mine["fasttrans-triton"]["status"] == "ok", mine["fasttrans-triton"]
        for r in mine.values():
            if r["status"] == "ok":
                assert float(r["median_ms"]) > 0 and float(r["speedup_vs_torch"]) > 0, r
            else:
                assert r["error"].strip(), r
    assert "Headline" in proc.stdout


@pytest.mark.gpu
def test_kernel_profile_names_the_kernels_of_a_call_and_their_total():
    a = torch.randn(512, 512, device="cuda")
    lines = common.kernel_profile(lambda: (a @ a).relu_(), top=1, calls=2)
    assert len(lines) == 2 and "ms" in lines[0] and "kernel launches per call in all" in lines[-1]
    assert float(lines[-1].split()[0]) > 0


def test_kernel_profiles_print_each_provider_that_ran_with_its_step_time(monkeypatch, capsys):
    from benchmarks import bench_model

    calls = []
    monkeypatch.setattr(common, "kernel_profile", lambda fn, top: calls.append((fn(), top)) or ["  1.000 ms  1.0x  k"])
    entries = [types.SimpleNamespace(key=(name, variant), make=lambda inp, name=name: lambda: name)
               for name, variant in (("fasttrans-triton", ""), ("torch", "sdpa"), ("torch", "eager"))]
    cfg = types.SimpleNamespace(inputs=lambda: None, entries=entries)
    results = [common.Result(cfg, "fasttrans-triton", "", "ok", timing=common.Timing([0.002])),
               common.Result(cfg, "torch", "sdpa", "ok", timing=common.Timing([0.001])),
               common.Result(cfg, "torch", "eager", "error", error="failed")]
    bench_model.print_kernel_profiles(cfg, results, 5)
    out = capsys.readouterr().out
    assert calls == [("fasttrans-triton", 5), ("torch", 5)]
    assert "fasttrans-triton (2.000 ms a step, wall)" in out and "torch [sdpa] (1.000 ms a step, wall)" in out
    assert "eager" not in out
