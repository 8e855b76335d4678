"""Training loop, checkpoints and resume, and the command line (python -m fasttrans)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from fasttrans import cli, train
from fasttrans.tasks import get_task, translate

TINY = dict(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=24, dropout=0.1)


def _config(tmp_path, task="average", name="run", **kw) -> train.TrainConfig:
    # one thread: these models are tiny, and a second thread only adds contention on a busy machine
    values = dict(out_dir=str(tmp_path / name), progress=False, plot=False, evaluate=False, threads=1)
    if task == "average":
        values.update(batch_size=4, steps=6, warmup_steps=2)
    values.update(kw)
    return train.resolve_config(task, values)


def _quiet(msg: str) -> None:
    pass


# --------------------------------------------------------------------------------------
# the translate task end to end
# --------------------------------------------------------------------------------------
def test_translate_trains_saves_and_reloads(tmp_path):
    lines = []
    config = _config(tmp_path, "translate", evaluate=True, plot=True)
    result = train.run(config, log=lines.append)
    text = "\n".join(lines)
    assert "backends: attention -> " in text
    assert result.step == config.steps and len(result.losses) == config.steps
    assert result.losses[-1] < 0.25 * result.losses[0]
    assert [out for _, _, out in result.report.translations] == ["i want a beer .", "i want a coke ."]
    # the checkpoint alone rebuilds a model that translates the same way
    model, ckpt = train.load_model(result.checkpoint)
    assert ckpt["step"] == config.steps and ckpt["task"] == "translate"
    assert translate.translate(model, "ich mochte ein bier") == "i want a beer ."
    assert translate.translate(model, "ich mochte ein cola") == "i want a coke ."
    with open(result.plot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(result.metrics) as f:
        metrics = json.load(f)
    assert metrics["report"]["accuracy"] == 1.0 and metrics["step"] == config.steps


def test_forced_backend_is_used_and_reported(tmp_path):
    result = train.run(_config(tmp_path, "translate", steps=2, backend="reference"), log=_quiet)
    assert result.backend == {"attention": "reference", "norm": "reference", "dropout": "reference"}


# --------------------------------------------------------------------------------------
# checkpoints and resume
# --------------------------------------------------------------------------------------
def _state(path):
    return torch.load(path, weights_only=True)


def test_resume_continues_exactly(tmp_path, monkeypatch):
    # an uninterrupted run that also checkpoints at step 3; keep a copy of that checkpoint
    middle = str(tmp_path / "step3.pt")
    save = train.save_checkpoint

    def save_and_copy(path, payload):
        save(path, payload)
        if payload["step"] == 3:
            save(middle, payload)

    monkeypatch.setattr(train, "save_checkpoint", save_and_copy)
    straight = train.run(_config(tmp_path, name="straight", checkpoint_every=3), TINY, log=_quiet)
    monkeypatch.undo()
    assert _state(middle)["step"] == 3
    resumed = train.run(_config(tmp_path, name="split", resume=middle), TINY, log=_quiet)
    assert resumed.step == 6
    assert resumed.losses == straight.losses  # same data, same dropout draws, same updates
    a, b = _state(straight.checkpoint), _state(resumed.checkpoint)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"] == 6
    for pid, s in a["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(v, b["optimizer"]["state"][pid][k]), (pid, k)
    # a run that does not restore the optimizer lands elsewhere: the comparison can fail
    ckpt = _state(middle)
    ckpt["optimizer"]["state"] = {}
    train.save_checkpoint(middle, ckpt)
    other = train.run(_config(tmp_path, name="other", resume=middle), TINY, log=_quiet)
    assert other.losses[:4] == straight.losses[:4] and other.losses[4:] != straight.losses[4:]


def test_resume_with_more_steps_follows_the_new_schedule(tmp_path):
    # 3 steps of a linear decay that ends at step 3, then extended to 6: from step 3 on the
    # learning rate is the 6-step schedule's (warmup 2, so steps 0-2 agree in both schedules)
    straight = train.run(_config(tmp_path, name="straight", schedule="linear"), TINY, log=_quiet)
    first = train.run(_config(tmp_path, steps=3, schedule="linear"), TINY, log=_quiet)
    assert _state(first.checkpoint)["optimizer"]["param_groups"][0]["lr"] == 0.0  # the 3-step decay ended
    extended = train.run(_config(tmp_path, schedule="linear", resume=first.checkpoint), TINY, log=_quiet)
    assert extended.losses == straight.losses


def test_checkpoint_is_weights_only_and_complete(tmp_path):
    result = train.run(_config(tmp_path, steps=2), TINY, log=_quiet)
    ckpt = torch.load(result.checkpoint, weights_only=True)
    assert ckpt["format"] == "fasttrans-checkpoint" and ckpt["step"] == 2
    assert ckpt["model_config"]["d_model"] == 16 and ckpt["train_config"]["batch_size"] == 4
    assert len(ckpt["losses"]) == 2 and ckpt["target_count"] == 8
    assert [f for f in os.listdir(os.path.dirname(result.checkpoint)) if f.endswith(".tmp")] == []


def test_atomic_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    train.save_checkpoint(path, {"a": torch.ones(3)})

    def failing_save(obj, f):
        f.write(b"partial data")
        raise OSError("disk full")

    monkeypatch.setattr(train.torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        train.save_checkpoint(path, {"a": torch.zeros(3)})
    monkeypatch.undo()
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.ones(3))
    assert os.listdir(tmp_path) == ["ckpt.pt"]


class _NotATensor:
    pass


def test_corrupted_checkpoints_give_clear_errors(tmp_path):
    good = train.run(_config(tmp_path, steps=2), TINY, log=_quiet).checkpoint
    data = open(good, "rb").read()
    cases = {
        "garbage.pt": b"this is not a checkpoint at all" * 10,
        "truncated.pt": data[: len(data) // 2],
    }
    for name, blob in cases.items():
        (tmp_path / name).write_bytes(blob)
    torch.save({"obj": _NotATensor()}, tmp_path / "pickle.pt")  # needs code to unpickle: refused
    for name in (*cases, "pickle.pt"):
        with pytest.raises(train.CheckpointError, match="cannot be read"):
            train.load_checkpoint(str(tmp_path / name))
    torch.save({"weights": torch.ones(2)}, tmp_path / "foreign.pt")
    with pytest.raises(train.CheckpointError, match="not a fasttrans training checkpoint"):
        train.load_checkpoint(str(tmp_path / "foreign.pt"))
    ckpt = _state(good)
    ckpt["version"] = 99
    train.save_checkpoint(str(tmp_path / "future.pt"), ckpt)
    with pytest.raises(train.CheckpointError, match="version 99"):
        train.load_checkpoint(str(tmp_path / "future.pt"))
    with pytest.raises(train.CheckpointError, match="no such file"):
        train.load_checkpoint(str(tmp_path / "missing.pt"))


def test_mismatched_checkpoints_give_clear_errors(tmp_path):
    good = train.run(_config(tmp_path, steps=2), TINY, log=_quiet).checkpoint
    with pytest.raises(train.CheckpointError, match=r"another model \(d_model: checkpoint 16, asked 32\)"):
        train.run(_config(tmp_path, resume=good), {**TINY, "d_model": 32}, log=_quiet)
    with pytest.raises(train.CheckpointError, match="for task 'average', not 'translate'"):
        train.run(_config(tmp_path, "translate", resume=good), log=_quiet)
    ckpt = _state(good)
    ckpt["model"]["generator.weight"] = torch.zeros(5, 5)
    train.save_checkpoint(str(tmp_path / "bad_weights.pt"), ckpt)
    with pytest.raises(train.CheckpointError, match="weights do not fit"):
        train.run(_config(tmp_path, resume=str(tmp_path / "bad_weights.pt")), TINY, log=_quiet)
    with pytest.raises(train.CheckpointError, match="past steps=1"):
        train.run(_config(tmp_path, steps=1, resume=good), TINY, log=_quiet)


# --------------------------------------------------------------------------------------
# configuration and schedule
# --------------------------------------------------------------------------------------
def test_schedules():
    c = train.TrainConfig(steps=110, warmup_steps=10, schedule="cosine")
    assert train.lr_factor(0, c) == pytest.approx(0.1)
    assert train.lr_factor(9, c) == pytest.approx(1.0)
    assert train.lr_factor(10, c) == pytest.approx(1.0)
    assert train.lr_factor(60, c) == pytest.approx(0.5)
    assert train.lr_factor(110, c) == pytest.approx(0.0)
    c.schedule = "linear"
    assert train.lr_factor(60, c) == pytest.approx(0.5)
    c.schedule = "constant"
    assert train.lr_factor(100, c) == 1.0
    c.schedule = "inverse_sqrt"
    assert train.lr_factor(39, c) == pytest.approx(0.5)


def test_resolve_config():
    c = train.resolve_config("average", {"batch_size": 100, "lr": None}, epochs=2)
    assert c.steps == 80 and c.out_dir == os.path.join("runs", "average")
    assert c.lr == get_task("average").train_defaults["lr"]
    assert train.resolve_config("translate").batch_size == 2
    with pytest.raises(ValueError, match="either steps or epochs"):
        train.resolve_config("average", {"steps": 3}, epochs=1)
    with pytest.raises(ValueError, match="unknown training settings"):
        train.resolve_config("average", {"momentum": 0.9})
    with pytest.raises(ValueError, match="task: expected one of"):
        train.resolve_config("summarize")
    with pytest.raises(ValueError, match="schedule"):
        train.resolve_config("average", {"schedule": "step"})


def test_shard():
    t = torch.arange(12).view(6, 2)
    assert torch.equal(torch.cat([train.shard(t, r, 3) for r in range(3)]), t)
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        train.shard(t, 0, 4)


# --------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------
def test_cli_demo_reports_model_and_baseline(tmp_path, capsys):
    argv = ["demo", "--steps", "2", "--batch-size", "4", "--d-model", "16", "--nhead", "2", "--layers", "1",
            "--ffn", "16", "--out-dir", str(tmp_path), "--no-progress", "--threads", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "backends: attention -> " in out
    assert "model (greedy)" in out and "baseline (0." in out and "examples" in out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    report = metrics["report"]
    assert 0.06 < report["baseline_mae"] < 0.085  # the constant predictor's MAE, about 0.073
    assert len(report["digit_accuracy"]) == 8 and report["n"] == 1000
    assert (tmp_path / "loss.png").exists() and (tmp_path / "checkpoint.pt").exists()
    # --resume without a path continues from <out-dir>/checkpoint.pt
    assert cli.main([*argv[:2], "4", *argv[3:], "--resume", "--no-eval"]) == 0
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 4


@pytest.mark.slow(minutes=5)
def test_demo_recipe_learns_the_task(tmp_path, capsys):
    """The main job as `make demo` runs it (default recipe, 2000 steps: a few minutes),
    on one thread: the suite's other worker keeps the machine's other core busy, and two
    threads each would contend for both. The model's held-out MAE is at least 6x below the
    constant baseline's."""
    assert cli.main(["demo", "--out-dir", str(tmp_path), "--no-progress", "--threads", "1"]) == 0
    report = json.loads((tmp_path / "metrics.json").read_text())["report"]
    assert report["n"] == 1000 and report["well_formed"] >= 0.99
    assert report["mae"] * 6 <= report["baseline_mae"], report
    assert report["digit_accuracy"][0] >= 0.9, report  # the leading digit of the mean
    capsys.readouterr()


@pytest.mark.parametrize("absent", [["matplotlib"], ["tqdm"], ["matplotlib", "tqdm"]], ids="+".join)
def test_demo_without_its_extra_says_what_to_install(tmp_path, capsys, monkeypatch, absent):
    """matplotlib and tqdm are the demo extra's, not the library's: without them the demo
    stops before training and names the packages and the extra."""
    for name in absent:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    assert cli.main(["demo", "--out-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'fasttrans[demo]'" in err and all(name in err for name in absent)
    assert not any(tmp_path.iterdir()), "nothing should be trained or written"


def test_cli_errors_are_reported(tmp_path, capsys, monkeypatch):
    (tmp_path / "checkpoint.pt").write_bytes(b"garbage")
    argv = ["train", "--task", "translate", "--out-dir", str(tmp_path), "--no-progress", "--resume"]
    assert cli.main(argv) == 2
    assert "error: checkpoint" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # Triton cannot run on the CPU: a forced request must fail
    assert cli.main(["train", "--task", "translate", "--steps", "1", "--backend", "triton", "--device", "cpu",
                     "--out-dir", str(tmp_path / "t"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "backend 'triton' was requested" in err and "interpreter" in err
    with pytest.raises(SystemExit):
        cli.main(["train", "--task", "summarize"])


@pytest.mark.parametrize("flags, message", [
    (["--nhead", "0"], "nhead: expected a positive integer"),
    (["--layers", "0"], "num_encoder_layers: expected a positive integer"),
    (["--device", "foo"], "device: expected auto, cpu, cuda or cuda:N"),
    (["--checkpoint-every", "-1"], "checkpoint_every"),
    (["--grad-clip", "-1"], "grad_clip"),
    (["--out-dir", "{file}"], "is not a directory"),
])
def test_cli_rejects_bad_settings_before_training(tmp_path, capsys, flags, message):
    (tmp_path / "file").write_text("")
    flags = [f.format(file=tmp_path / "file") for f in flags]
    argv = ["train", "--task", "translate", "--steps", "2", "--no-progress", "--no-plot", "--no-eval"]
    if "--out-dir" not in flags:
        argv += ["--out-dir", str(tmp_path / "out")]
    assert cli.main(argv + flags) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "training:" not in captured.out


def test_checkpoint_permissions_follow_the_umask(tmp_path):
    result = train.run(_config(tmp_path, steps=1), TINY, log=_quiet)
    mask = os.umask(0o022)
    os.umask(mask)
    assert os.stat(result.checkpoint).st_mode & 0o777 == 0o666 & ~mask


def test_cli_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch      {torch.__version__}" in out
    for name in ("triton", "extension", "reference"):
        assert f"  {name} " in out
    assert "selected for attention on cpu:" in out and "selected for norm on cpu:" in out


def test_cli_compile_check_dispatch(monkeypatch, capsys):
    seen = []
    fake = types.ModuleType("fasttrans.compile_check")
    fake.main = lambda argv: seen.append(list(argv)) or 0
    monkeypatch.setitem(sys.modules, "fasttrans.compile_check", fake)
    assert cli.main(["compile-check", "--arch", "sm_80,sm_90", "--json"]) == 0
    assert seen == [["--arch", "sm_80,sm_90", "--json"]]
    monkeypatch.setitem(sys.modules, "fasttrans.compile_check", None)  # as if it were not installed
    assert cli.main(["compile-check"]) == 2
    assert "fasttrans.compile_check is not part of this installation" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "fasttrans", "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for command in ("info", "demo", "train", "compile-check"):
        assert command in proc.stdout


def test_time_limit_stops_early_and_saves(tmp_path):
    lines = []
    result = train.run(_config(tmp_path, time_limit=0.0), TINY, log=lines.append)
    assert result.stopped_early and result.step == 1
    assert _state(result.checkpoint)["step"] == 1
    assert any("--resume" in line for line in lines)
