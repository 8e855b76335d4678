"""Training loop for the seed tasks: schedule, checkpoints, resume, DistributedDataParallel.

One entry point, :func:`run`, used by ``python -m fasttrans train`` and ``demo``::

    task batch (global, a pure function of seed and step)
      └─► this rank's shard ─► Seq2SeqTransformer (optionally DDP, torch.compile)
            └─► cross-entropy on tgt[:, 1:] ─► AdamW + warmup schedule ─► checkpoint.pt

Checkpoints are written atomically (temporary file, then rename) and hold only tensors and
plain containers, so they load with ``torch.load(weights_only=True)``. They carry the model
and training configs, so a checkpoint alone rebuilds its model (:func:`load_model`).

Distributed: under ``torchrun`` (WORLD_SIZE > 1) each process joins a process group (gloo
on CPU, nccl on CUDA), every rank builds the same global batch and keeps its slice, and
DDP averages the gradients: one step equals a single-process step on the global batch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import backends
from .models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer
from .tasks import Task, get_task

__all__ = [
    "TrainConfig",
    "TrainResult",
    "CheckpointError",
    "CHECKPOINT_NAME",
    "resolve_config",
    "build_model",
    "shard",
    "compute_loss",
    "lr_factor",
    "save_checkpoint",
    "load_checkpoint",
    "load_model",
    "plot_losses",
    "run",
]

CHECKPOINT_FORMAT = "fasttrans-checkpoint"
CHECKPOINT_VERSION = 1
CHECKPOINT_NAME = "checkpoint.pt"
SCHEDULES = ("constant", "cosine", "linear", "inverse_sqrt")
BACKEND_CHOICES = ("auto", *backends.BACKEND_NAMES)


@dataclasses.dataclass
class TrainConfig:
    """Training settings; a task fills in its own defaults (fasttrans.tasks)."""

    task: str = "average"
    steps: int = 2000  # total optimizer steps (a resumed run continues up to this count)
    batch_size: int = 64  # global batch, split evenly across distributed ranks
    lr: float = 3e-3  # peak learning rate (AdamW)
    schedule: str = "cosine"  # after warmup: constant | cosine (to 0) | linear (to 0) | inverse_sqrt
    warmup_steps: int = 150  # linear warmup from lr / warmup_steps
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int | None = None  # CPU threads for torch (None: torch's default, one per core)
    backend: str = "auto"  # auto | triton | extension | reference (forced: never falls back)
    out_dir: str = "runs/average"
    resume: str | None = None  # checkpoint to continue from
    compile: bool = False  # torch.compile(fullgraph=True) the training forward
    checkpoint_every: int = 0  # also save every N steps (0: only at the end)
    time_limit: float | None = None  # minutes; stop early (and save) when exceeded
    evaluate: bool = True
    plot: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected a positive learning rate, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: expected >= 0, got {self.warmup_steps}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every: expected >= 0 (0: only at the end), got {self.checkpoint_every}")
        if not self.grad_clip >= 0:
            raise ValueError(f"grad_clip: expected >= 0 (0: no clipping), got {self.grad_clip}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"backend: expected one of {', '.join(BACKEND_CHOICES)}, got {self.backend!r}")
        self.betas = tuple(self.betas)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class TrainResult:
    step: int  # optimizer steps done in total (resumed runs included)
    losses: list[float]  # training loss of every step since step 0
    report: Any  # the task's held-out report (None without evaluation, and on ranks > 0)
    checkpoint: str
    plot: str | None
    metrics: str | None
    device: str
    backend: dict[str, str]  # op -> backend that ran it
    world_size: int
    train_seconds: float
    stopped_early: bool


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read, is not a fasttrans checkpoint, or does not match the run."""


# --------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------
def resolve_config(task_name: str, overrides: dict[str, Any] | None = None, epochs: float | None = None) -> TrainConfig:
    """TrainConfig from the task's defaults, then ``overrides`` (None values ignored).

    ``epochs`` converts to steps with the task's epoch size (seed 001: 4000 samples).
    """
    task = get_task(task_name)
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(given) - fields)
    if unknown:
        raise ValueError(f"unknown training settings {unknown}")
    values = {"task": task_name, "out_dir": os.path.join("runs", task_name), **task.train_defaults, **given}
    if epochs is not None:
        if "steps" in given:
            raise ValueError("epochs: give either steps or epochs, not both")
        if not epochs > 0:
            raise ValueError(f"epochs: expected a positive number, got {epochs}")
        values["steps"] = max(1, math.ceil(epochs * task.samples_per_epoch / values["batch_size"]))
    return TrainConfig(**values)


def _model_config(task: Task, base: Seq2SeqConfig | None, overrides: dict[str, Any]) -> Seq2SeqConfig:
    config = base if base is not None else task.model_config()
    fields = {f.name for f in dataclasses.fields(Seq2SeqConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown model settings {unknown}")
    return dataclasses.replace(config, **overrides)


def lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of the peak learning rate for the update made at ``step`` (0-based)."""
    warmup = config.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if config.schedule == "constant":
        return 1.0
    if config.schedule == "inverse_sqrt":
        return math.sqrt(max(warmup, 1) / (step + 1))
    t = min(1.0, (step - warmup) / max(1, config.steps - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * t)) if config.schedule == "cosine" else 1.0 - t


# --------------------------------------------------------------------------------------
# model, data, loss
# --------------------------------------------------------------------------------------
def build_model(config: Seq2SeqConfig, seed: int, device: torch.device | str = "cpu") -> Seq2SeqTransformer:
    """The model, initialised from ``seed`` (the same weights on every rank)."""
    torch.manual_seed(seed)
    return Seq2SeqTransformer(config).to(device)


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rows of this rank: the global batch cut into world_size equal, contiguous slices."""
    if t.shape[0] % world_size != 0:
        raise ValueError(
            f"batch_size: the global batch ({t.shape[0]}) must be a multiple of the number of processes ({world_size})"
        )
    n = t.shape[0] // world_size
    return t[rank * n : (rank + 1) * n]


def compute_loss(model, src: torch.Tensor, tgt: torch.Tensor, config: Seq2SeqConfig) -> torch.Tensor:
    """Teacher-forced token cross-entropy: read tgt[:, :-1], predict tgt[:, 1:] (pad ignored)."""
    out = model(src, tgt[:, :-1])  # (B, T - 1, V)
    target = tgt[:, 1:]
    ignore = config.tgt_pad_idx if config.tgt_pad_idx is not None else -100
    out, target = out.reshape(-1, out.shape[-1]), target.reshape(-1)
    if config.log_softmax:  # the generator already returns log-probabilities
        return F.nll_loss(out, target, ignore_index=ignore)
    return F.cross_entropy(out, target, ignore_index=ignore)


# --------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------
def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def save_checkpoint(path: str, payload: dict[str, Any]) -> None:
    """torch.save to a temporary file in the same directory, fsync, then rename over ``path``.

    A crash mid-write leaves the previous checkpoint intact: the rename is atomic.
    """
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file 0600; a plain save respects the umask
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_REQUIRED_KEYS = ("task", "step", "model_config", "train_config", "model", "optimizer", "scheduler", "losses")


def load_checkpoint(path: str) -> dict[str, Any]:
    """Read and check a checkpoint (``torch.load(weights_only=True)``, on the CPU)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r}: no such file")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, random bytes, a pickle with code in it, ...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(
            f"checkpoint {path!r} cannot be read (corrupted, truncated, or not a weights-only torch file): "
            f"{type(e).__name__}: {reason}"
        ) from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {path!r} is not a fasttrans training checkpoint")
    if ckpt.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"checkpoint {path!r} has format version {ckpt.get('version')!r}; this fasttrans reads version "
            f"{CHECKPOINT_VERSION}"
        )
    missing = [k for k in _REQUIRED_KEYS if k not in ckpt]
    if missing:
        raise CheckpointError(f"checkpoint {path!r} lacks {missing}")
    return ckpt


def _load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], path: str) -> None:
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {path!r}: its weights do not fit the model: {e}") from e


def load_model(path: str, device: torch.device | str = "cpu") -> tuple[Seq2SeqTransformer, dict[str, Any]]:
    """Rebuild the trained model of a checkpoint (in eval mode); returns (model, checkpoint)."""
    ckpt = load_checkpoint(path)
    try:
        config = Seq2SeqConfig.from_dict(ckpt["model_config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path!r}: invalid model config: {e}") from e
    model = Seq2SeqTransformer(config)
    _load_weights(model, ckpt["model"], path)
    return model.to(device).eval(), ckpt


def _check_resume(ckpt: dict[str, Any], path: str, config: TrainConfig, model_overrides: dict[str, Any]) -> None:
    if ckpt["task"] != config.task:
        raise CheckpointError(f"checkpoint {path!r} is for task {ckpt['task']!r}, not {config.task!r}")
    saved = ckpt["model_config"]
    differing = {k: (saved.get(k), v) for k, v in model_overrides.items() if saved.get(k) != v}
    if differing:
        detail = ", ".join(f"{k}: checkpoint {a!r}, asked {b!r}" for k, (a, b) in differing.items())
        raise CheckpointError(f"checkpoint {path!r} was trained with another model ({detail})")
    if ckpt["step"] > config.steps:
        raise CheckpointError(
            f"checkpoint {path!r} is at step {ckpt['step']}, past steps={config.steps}: ask for more steps to continue"
        )


# --------------------------------------------------------------------------------------
# distributed
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Dist:
    rank: int = 0
    world_size: int = 1
    owns_group: bool = False  # we initialised the process group, so we tear it down

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def _pick_device(name: str, local_rank: int, distributed: bool) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {name!r}") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {name!r} was asked for but torch sees no CUDA device")
        if distributed and device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def _init_distributed(device_name: str) -> tuple[_Dist, torch.device]:
    """Join the torchrun process group when WORLD_SIZE > 1 (or reuse one already set up)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        d = _Dist(dist.get_rank(), dist.get_world_size(), owns_group=False)
        return d, _pick_device(device_name, int(os.environ.get("LOCAL_RANK", d.rank)), d.enabled)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return _Dist(), _pick_device(device_name, 0, False)
    rank = int(os.environ["RANK"])
    device = _pick_device(device_name, int(os.environ.get("LOCAL_RANK", rank)), True)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    return _Dist(rank, world_size, owns_group=True), device


def _all_mean(value: torch.Tensor, d: _Dist) -> torch.Tensor:
    if not d.enabled:
        return value
    import torch.distributed as dist

    value = value.detach().clone()
    dist.all_reduce(value)
    return value / d.world_size


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _gather_rng(d: _Dist, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Every rank's RNG states (dropout draws differ per rank), in rank order."""
    state = _rng_state(device)
    if not d.enabled:
        return [state]
    import torch.distributed as dist

    states: list[Any] = [None] * d.world_size
    dist.all_gather_object(states, state)
    return states


def _time_is_up(elapsed: float, minutes: float, d: _Dist) -> bool:
    """Rank 0's clock decides for everyone: ranks that stopped at different steps would hang."""
    up = torch.tensor([1 if elapsed > 60 * minutes else 0])
    if d.enabled:
        import torch.distributed as dist

        if dist.get_backend() == "nccl":
            up = up.cuda()
        dist.broadcast(up, src=0)
    return bool(up.item())


# --------------------------------------------------------------------------------------
# the loss curve
# --------------------------------------------------------------------------------------
def plot_losses(losses: list[float], path: str, title: str) -> str:
    """Loss per step and its moving average as a PNG (matplotlib's Agg canvas, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="loss per step")
    ema, smooth = [], None
    for x in losses:
        smooth = x if smooth is None else 0.95 * smooth + 0.05 * x
        ema.append(smooth)
    ax.plot(steps, ema, color="tab:blue", linewidth=1.8, label="moving average (0.95)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy per token")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


# --------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------
def _backend_names(device: torch.device) -> dict[str, str]:
    """op -> the backend that will run it; also registers those backends' torch.library ops.

    Registration happens on first use, and registering (torch.library.register_fake) inside
    a torch.compile trace is a graph break: doing it here, eagerly, lets --compile trace a
    fresh process with fullgraph=True.
    """
    names = {op: backends.select_backend(op, device).name for op in backends.OPS}
    for name in set(names.values()):
        backends.ops_for(name)
    return names


def _check_out_dir(out_dir: str) -> None:
    """Raise ValueError unless ``out_dir`` is, or can be made, a writable directory."""
    existing = os.path.abspath(out_dir)
    while not os.path.exists(existing):  # the nearest part of the path that exists
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"out_dir: {out_dir!r} is not a directory ({existing!r} is a file)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"out_dir: {out_dir!r} cannot be written ({existing!r} is not writable)")


def run(
    config: TrainConfig,
    model_overrides: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> TrainResult:
    """Train ``config.task``; save, evaluate and plot on rank 0. See the module docstring."""
    from tqdm.auto import tqdm

    task = get_task(config.task)
    model_overrides = dict(model_overrides or {})
    _check_out_dir(config.out_dir)  # before training, not when the first save fails
    threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    d, device = _init_distributed(config.device)
    say = log if d.rank == 0 else (lambda msg: None)
    forced = None if config.backend == "auto" else config.backend
    try:
        with backends.use_backend(forced):
            return _run(config, task, model_overrides, d, device, say, tqdm)
    finally:
        torch.set_num_threads(threads)
        if d.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def _run(config, task, model_overrides, d, device, say, tqdm) -> TrainResult:
    ckpt = None
    if config.resume:
        ckpt = load_checkpoint(config.resume)
        _check_resume(ckpt, config.resume, config, model_overrides)
        base = Seq2SeqConfig.from_dict(ckpt["model_config"])
    else:
        base = None
    model_config = _model_config(task, base, model_overrides)
    used = _backend_names(device)  # raises here, before any work, if a forced backend cannot run
    model = build_model(model_config, config.seed, device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    step, losses, target_sum, target_count = 0, [], 0.0, 0
    if ckpt is not None:
        _load_weights(model, ckpt["model"], config.resume)
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
            scheduler.load_state_dict(ckpt["scheduler"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {config.resume!r}: optimizer state does not fit: {e}") from e
        step, losses = int(ckpt["step"]), [float(x) for x in ckpt["losses"]]
        # the schedule is a function of (step, this run's settings): a run resumed with more
        # steps or another peak lr follows the new schedule from where the old one stopped
        scheduler.base_lrs = [config.lr for _ in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["initial_lr"] = config.lr
            group["lr"] = config.lr * lr_factor(step, config)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        target_sum, target_count = float(ckpt.get("target_sum", 0.0)), int(ckpt.get("target_count", 0))
        rng = ckpt.get("rng")
        if rng is not None and len(rng) == d.world_size:
            _set_rng_state(rng[d.rank], device)
        else:
            torch.manual_seed(config.seed + 7919 * (d.rank + 1) + step)
    elif d.enabled:
        torch.manual_seed(config.seed + 7919 * d.rank)  # distinct dropout draws per rank

    train_model: torch.nn.Module = model
    if config.compile:
        train_model = torch.compile(train_model, fullgraph=True)
    if d.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(train_model, device_ids=[device.index] if device.type == "cuda" else None)

    n_params = model.num_parameters()
    say(f"task: {task.name} ({task.description})")
    say(
        f"device: {device}   processes: {d.world_size}   backends: "
        + ", ".join(f"{op} -> {name}" for op, name in used.items())
        + ("   (torch.compile)" if config.compile else "")
    )
    c = model_config
    say(
        f"model: d_model={c.d_model} nhead={c.nhead} layers={c.num_encoder_layers}+{c.num_decoder_layers} "
        f"ffn={c.dim_feedforward} {'pre' if c.norm_first else 'post'}-norm dropout={c.dropout}, "
        f"{n_params:,} parameters"
    )
    say(
        f"training: steps={config.steps} batch={config.batch_size} lr={config.lr:g} "
        f"warmup={config.warmup_steps} schedule={config.schedule} seed={config.seed}"
        + (f"   resumed at step {step}" if ckpt is not None else "")
    )

    out_dir = config.out_dir
    ckpt_path = os.path.join(out_dir, CHECKPOINT_NAME)

    def save(at_step: int) -> None:
        rng = _gather_rng(d, device)
        if d.rank == 0:
            save_checkpoint(ckpt_path, {
                "format": CHECKPOINT_FORMAT,
                "version": CHECKPOINT_VERSION,
                "task": task.name,
                "step": at_step,
                "model_config": model_config.to_dict(),
                "train_config": config.to_dict(),
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "losses": list(losses),
                "target_sum": target_sum,
                "target_count": target_count,
                "rng": rng,
            })

    bar = tqdm(
        total=config.steps, initial=step, disable=not config.progress or d.rank != 0,
        unit="step", dynamic_ncols=True, mininterval=0.5,
    )
    model.train()
    t0 = time.perf_counter()
    tokens, ema, stopped_early = 0, None, False
    while step < config.steps:
        src, tgt, values = task.batch(step, config.batch_size, config.seed)
        if values is not None:
            target_sum += float(values.sum())
            target_count += values.numel()
        src = shard(src, d.rank, d.world_size).to(device)
        tgt = shard(tgt, d.rank, d.world_size).to(device)
        loss = compute_loss(train_model, src, tgt, model_config)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        value = float(_all_mean(loss.detach(), d))
        if not math.isfinite(value):
            raise FloatingPointError(f"training diverged: loss {value} at step {step} (try a lower lr or more warmup)")
        losses.append(value)
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        tokens += (src.numel() + tgt.numel() - tgt.shape[0]) * d.world_size
        elapsed = time.perf_counter() - t0
        bar.set_postfix_str(f"loss {ema:.4f}  {tokens / elapsed:,.0f} tok/s  lr {scheduler.get_last_lr()[0]:.2e}")
        bar.update(1)
        if config.checkpoint_every and step % config.checkpoint_every == 0 and step < config.steps:
            save(step)
        if config.time_limit is not None and step < config.steps and _time_is_up(elapsed, config.time_limit, d):
            stopped_early = True
            break
    bar.close()
    train_seconds = time.perf_counter() - t0
    save(step)
    if stopped_early:
        say(f"time limit of {config.time_limit:g} min reached at step {step}; continue with --resume {ckpt_path}")
    say(
        f"trained {step} steps in {train_seconds:.1f} s ({tokens / max(train_seconds, 1e-9):,.0f} tokens/s); "
        f"checkpoint: {ckpt_path}"
    )

    report = plot = metrics = None
    if d.rank == 0:
        train_mean = target_sum / target_count if target_count else None
        if config.evaluate:
            t_eval = time.perf_counter()
            report = task.evaluate(model, device, train_mean)
            say(report.format())
            say(f"(evaluation took {time.perf_counter() - t_eval:.1f} s)")
        if config.plot and losses:
            plot = plot_losses(losses, os.path.join(out_dir, "loss.png"), f"fasttrans {task.name}: training loss")
            say(f"loss curve: {plot}")
        metrics = os.path.join(out_dir, "metrics.json")
        with open(metrics, "w") as f:
            json.dump({
                "task": task.name,
                "step": step,
                "train_seconds": train_seconds,
                "final_loss": losses[-1] if losses else None,
                "device": str(device),
                "backends": used,
                "world_size": d.world_size,
                "parameters": n_params,
                "model_config": model_config.to_dict(),
                "train_config": config.to_dict(),
                "report": report.to_dict() if report is not None else None,
            }, f, indent=2)
    if d.enabled:
        import torch.distributed as dist

        dist.barrier()
    return TrainResult(
        step=step, losses=losses, report=report, checkpoint=ckpt_path, plot=plot, metrics=metrics,
        device=str(device), backend=used, world_size=d.world_size, train_seconds=train_seconds,
        stopped_early=stopped_early,
    )
