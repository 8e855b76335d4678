"""python -m fasttrans: info, demo, train, compile-check.

    info            versions, devices, and which backend can run each op, with the reason
    demo            train the seed 001 digits-average task with the default recipe and report
    train           train a seed task (--task average|translate) with any settings
    compile-check   compile every Triton kernel for sm_80/sm_90 (fasttrans.compile_check)
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
from typing import Sequence

__all__ = ["main"]


# --------------------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------------------
def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown version")
    except Exception as e:  # not installed, or broken: say which
        return f"not importable ({type(e).__name__}: {e})"


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    import fasttrans
    from fasttrans import backends

    print("versions")
    print(f"  python     {platform.python_version()} ({sys.executable})")
    print(f"  torch      {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    print(f"  triton     {_version('triton')}")
    print(f"  fasttrans  {fasttrans.__version__} ({os.path.dirname(fasttrans.__file__)})")
    print(f"  TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r}"
          f"  FASTTRANS_BACKEND={os.environ.get('FASTTRANS_BACKEND', '')!r}")
    print("devices")
    print(f"  cpu        {platform.machine()}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}")
    has_cuda = torch.cuda.is_available()
    if has_cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"  cuda:{i}     {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB")
    else:
        print("  cuda       none visible to torch")
    print("backends (op on device: available, or why not)")
    for device in ("cpu", "cuda"):
        for name, backend in backends.BACKENDS.items():
            for op in backends.OPS:
                why = backend.unavailable_reason(device, op)
                if device == "cuda" and not has_cuda:
                    # a backend may have nothing against CUDA in principle; the machine has none
                    why = "no CUDA device visible to torch" + (f" (and: {why})" if why else "")
                print(f"  {name:<10} {op:<9} {device:<5} {'available' if why is None else why}")
        if device == "cuda" and not has_cuda:
            continue
        for op in backends.OPS:
            try:
                chosen = backends.select_backend(op, device).name
            except Exception as e:  # a forced backend that cannot run
                chosen = f"error: {e}"
            print(f"  selected for {op} on {device}: {chosen}")
    try:
        extension = importlib.import_module("fasttrans.extension")
    except ImportError:
        extension = None
    build_info = getattr(extension, "build_info", None)
    if callable(build_info):
        print("extension build")
        try:
            info = build_info()
        except Exception as e:
            info = f"unavailable ({type(e).__name__}: {e})"
        if isinstance(info, dict):
            for k, v in info.items():
                print(f"  {k}: {v}")
        else:
            print(f"  {info}")
        tiles = extension.cpu_attention_tiles()
        if tiles is not None:
            (fm, fn), (bm, bn) = tiles["forward"], tiles["backward"]
            basis = f"{tiles['l2_bytes'] // 1024} KiB of L2" if tiles["l2_bytes"] else "FASTTRANS_CPU_ATTENTION_TILES"
            print(f"  CPU attention tiles, head dim 64: forward {fm}x{fn}, backward {bm}x{bn} ({basis})")
    return 0


# --------------------------------------------------------------------------------------
# train / demo
# --------------------------------------------------------------------------------------
_MODEL_FLAGS = {
    # flag -> Seq2SeqConfig field
    "d_model": "d_model",
    "nhead": "nhead",
    "encoder_layers": "num_encoder_layers",
    "decoder_layers": "num_decoder_layers",
    "ffn": "dim_feedforward",
    "dropout": "dropout",
    "norm_first": "norm_first",
}
_TRAIN_FLAGS = (
    "steps", "batch_size", "lr", "schedule", "warmup_steps", "weight_decay", "grad_clip", "seed",
    "device", "threads", "backend", "out_dir", "resume", "compile", "checkpoint_every", "time_limit",
)


def _add_train_args(p: argparse.ArgumentParser) -> None:
    from fasttrans.train import BACKEND_CHOICES, SCHEDULES

    g = p.add_argument_group("training (defaults come from the task)")
    length = g.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps in total")
    length.add_argument("--epochs", type=float, help="epochs of the task's epoch size (average: 4000 samples)")
    g.add_argument("--batch-size", type=int, help="global batch size (split across processes)")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--schedule", choices=SCHEDULES, help="learning-rate schedule after warmup")
    g.add_argument("--warmup-steps", type=int, help="linear warmup steps")
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--grad-clip", type=float, help="max gradient norm (0: off)")
    g.add_argument("--seed", type=int)
    g.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--threads", type=int,
                   help="CPU threads for torch (default: one per core; 1 is faster on a busy machine)")
    g.add_argument("--backend", choices=BACKEND_CHOICES, help="force a kernel backend (default: best available)")
    g.add_argument("--out-dir", help="where the checkpoint, loss curve and metrics go (default runs/<task>)")
    g.add_argument("--resume", nargs="?", const="", metavar="CHECKPOINT",
                   help="continue from a checkpoint (default: <out-dir>/checkpoint.pt)")
    g.add_argument("--compile", action="store_true", default=None, help="torch.compile(fullgraph=True) the model")
    g.add_argument("--checkpoint-every", type=int, help="also save every N steps")
    g.add_argument("--time-limit", type=float, metavar="MINUTES", help="stop early (and save) after this long")
    g.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation")
    g.add_argument("--no-plot", action="store_true", help="skip the loss-curve PNG")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    m = p.add_argument_group("model (defaults come from the task)")
    m.add_argument("--d-model", type=int)
    m.add_argument("--nhead", type=int)
    m.add_argument("--layers", type=int, help="encoder and decoder layers")
    m.add_argument("--encoder-layers", type=int)
    m.add_argument("--decoder-layers", type=int)
    m.add_argument("--ffn", type=int, help="feed-forward width")
    m.add_argument("--dropout", type=float)
    norm = m.add_mutually_exclusive_group()
    norm.add_argument("--pre-norm", dest="norm_first", action="store_const", const=True)
    norm.add_argument("--post-norm", dest="norm_first", action="store_const", const=False)


def _missing_demo_packages() -> list[str]:
    """The packages of the ``demo`` extra (progress bars, the loss plot) that do not import."""
    missing = []
    for name in ("matplotlib", "tqdm"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    return missing


def _train(args: argparse.Namespace, task: str) -> int:
    missing = _missing_demo_packages()
    if missing:
        print(f"fasttrans {args.command}: error: training needs {' and '.join(missing)}, which the library itself "
              f"does not; install them with: pip install 'fasttrans[demo]' (or: pip install {' '.join(missing)})",
              file=sys.stderr)
        return 2
    from fasttrans import train

    overrides = {name: getattr(args, name) for name in _TRAIN_FLAGS}
    # the --no-* switches only ever turn things off; None keeps the default (on)
    overrides.update(evaluate=False if args.no_eval else None, plot=False if args.no_plot else None,
                     progress=False if args.no_progress else None)
    if args.layers is not None:
        args.encoder_layers = args.encoder_layers if args.encoder_layers is not None else args.layers
        args.decoder_layers = args.decoder_layers if args.decoder_layers is not None else args.layers
    model = {field: getattr(args, flag) for flag, field in _MODEL_FLAGS.items() if getattr(args, flag) is not None}
    try:
        config = train.resolve_config(task, overrides, epochs=args.epochs)
        if config.resume == "":
            config.resume = os.path.join(config.out_dir, train.CHECKPOINT_NAME)
        train.run(config, model)
    except (train.CheckpointError, ValueError, FloatingPointError) as e:
        print(f"fasttrans {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from fasttrans.backends import BackendUnavailableError

        if isinstance(e, BackendUnavailableError):
            print(f"fasttrans {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    return _train(args, args.task)


def cmd_demo(args: argparse.Namespace) -> int:
    print("fasttrans demo: seed 001's digits-average task on fasttrans.models.Seq2SeqTransformer")
    return _train(args, "average")


# --------------------------------------------------------------------------------------
# compile-check
# --------------------------------------------------------------------------------------
def cmd_compile_check(argv: list[str]) -> int:
    try:
        module = importlib.import_module("fasttrans.compile_check")
    except ModuleNotFoundError as e:
        if e.name != "fasttrans.compile_check":
            raise  # the module exists but one of its own imports is missing: show the real error
        print("fasttrans compile-check: error: fasttrans.compile_check is not part of this installation",
              file=sys.stderr)
        return 2
    return int(module.main(argv) or 0)


# --------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fasttrans", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{info,demo,train,compile-check}")
    sub.add_parser("info", help="versions, devices and backend availability").set_defaults(func=cmd_info)
    demo = sub.add_parser("demo", help="train and evaluate the digits-average task (seed 001)")
    _add_train_args(demo)
    demo.set_defaults(func=cmd_demo)
    train = sub.add_parser("train", help="train a seed task")
    train.add_argument("--task", choices=("average", "translate"), default="average")
    _add_train_args(train)
    train.set_defaults(func=cmd_train)
    sub.add_parser("compile-check", add_help=False,
                   help="compile the Triton kernels for GPU targets (arguments: see compile-check --help)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compile-check":
        return cmd_compile_check(argv[1:])  # its own parser owns every argument after the name
    args = _parser().parse_args(argv)
    return args.func(args)
