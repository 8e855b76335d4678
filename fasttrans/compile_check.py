"""``python -m fasttrans compile-check``: build every Triton kernel for sm_80 / sm_90 without a GPU.

Each module in ``kernels/`` (``fasttrans.kernels.*``) exposes ``compile_targets() -> list[dict]``,
one dict per (kernel, shipped launch configuration, specialisation):

    kernel      name of the kernel (str)
    fn          the @triton.jit function
    config      short name of the launch configuration (str)
    signature   {argument name: triton type string}, e.g. "*fp16", "i32", "i64", "fp32"
    constexprs  {argument name: value} (constexpr parameters, and runtime arguments the launcher
                specialises, as Triton does for integers equal to 1)
    num_warps, num_stages
    matmul      whether the kernel's tl.dot calls must lower to tensor-core instructions
    divisible_by_16  (optional) integer arguments assumed to be multiples of 16, as Triton's
                launcher specialises them at run time; pointer arguments are always assumed
                16-byte aligned (what torch allocations give)
    archs       (optional) the architectures the configuration ships for, e.g. ["sm_90"]
                (default: all); it is built only for those among the requested ones
    wgmma       (optional, default True) whether a matmul target must use wgmma on sm_90;
                False accepts mma.sync there too (tiles below wgmma's 64 rows)
    loop_scores (optional) score elements one iteration of the kernel's main loop computes
                (BLOCK_M * BLOCK_N for attention): its SASS is then counted per element
    loop_goal   (optional) the most SASS instructions per score element the main loop may take
                on sm_90 (a static goal the target must meet)
    partial_loop (optional) whether to count the loop after the main one as well (attention
                with a dense mask: the loop over tiles whose mask it reads)

Every target is compiled with ``triton.compile`` for each requested architecture and checked:

    registers, spills   of the binary Triton built (``cuobjdump -res-usage``): its registers
                        per thread and its stack frame in bytes, where ptxas puts the
                        registers it spills (any frame fails the build), so these are the
                        counts of the code that launches, under the options Triton's own
                        ptxas run adds (Triton 3.9: --regAllocOptLevel=2)
    shared_bytes        ``metadata.shared``; must fit the architecture's per-block limit
    tensor_cores        every tl.dot lowered to mma.sync (sm_80) or wgmma (sm_90; mma.sync too
                        for targets with wgmma=False)
    tma                 whether the kernel loads through the Tensor Memory Accelerator (sm_90)
    wgmma_shapes        the wgmma instruction shapes used, e.g. "m64n64k16"
    loop_per_element    for targets with loop_scores: SASS instructions per score element in
                        the main loop: the innermost loop that issues the most tensor-core
                        instructions, of several such the shortest (the loop over full tiles
                        rather than its masked copy), the first of equals (instructions x 32 x
                        num_warps / loop_scores: what one thread executes per score it owns)
    partial_loop_per_element  for targets with partial_loop: the same count for the next
                        such loop in that order (of equal length, the first)

A build is ``ok`` when it compiles, spills nothing, fits in shared memory, for ``matmul``
targets uses tensor cores, and on sm_90 keeps its main loop within ``loop_goal``. The exit
status is 0 only when every build is ok; a kernels module that cannot be imported or has no
``compile_targets`` is reported as a failed row.

The compilation runs in worker subprocesses without ``TRITON_INTERPRET``: with the
interpreter on (as in the CPU test suite), ``@triton.jit`` yields interpreter objects that
cannot be compiled. Results are cached by Triton (``~/.triton/cache``), so a second run only
reads the cached binaries.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

__all__ = ["main", "KERNEL_MODULES", "ARCHS"]

# the kernels modules that must expose compile_targets(); others found in the package are added
KERNEL_MODULES = ("attention", "layernorm", "dropout")
ARCHS = {"sm_80": 80, "sm_90": 90}
# largest dynamic shared memory a block may use (CUDA C Programming Guide, compute capabilities)
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
_REQUIRED_KEYS = ("kernel", "fn", "config", "signature", "constexprs", "num_warps", "num_stages", "matmul")
_RESULT_KEYS = ("kernel", "config", "arch", "ok", "registers", "spills", "shared_bytes", "tensor_cores", "tma",
                "wgmma_shapes", "loop_per_element", "partial_loop_per_element", "error")


# --------------------------------------------------------------------------------------
# Worker side (runs without the interpreter)
# --------------------------------------------------------------------------------------
def _problem(kernel: str, error: str, arch: str = "-") -> dict:
    return dict(kernel=kernel, config="-", arch=arch, ok=False, registers=None, spills=None,
                shared_bytes=None, tensor_cores=None, tma=None, wgmma_shapes=None, loop_per_element=None,
                partial_loop_per_element=None, error=error)


def _module_names() -> list[str]:
    """KERNEL_MODULES plus any other module found in fasttrans.kernels."""
    names = list(KERNEL_MODULES)
    try:
        import pkgutil

        pkg = importlib.import_module("fasttrans.kernels")
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.startswith("_") and info.name not in names:
                names.append(info.name)
    except Exception:  # the package itself is broken: each expected module reports it below
        pass
    return names


def _collect(modules: list[str]) -> tuple[list[tuple[str, dict]], list[dict]]:
    """(module, target) pairs in a deterministic order, and rows for modules that cannot be checked."""
    targets, problems = [], []
    for name in modules:
        # a bare name is a module of fasttrans.kernels; a dotted one is imported as given
        qualified = name if "." in name else f"fasttrans.kernels.{name}"
        where = name if "." in name else f"kernels/{name}.py"
        try:
            mod = importlib.import_module(qualified)
        except ModuleNotFoundError as e:
            problems.append(_problem(where, f"module not found ({e})"))
            continue
        except Exception as e:
            problems.append(_problem(where, f"import failed: {type(e).__name__}: {e}"))
            continue
        fn = getattr(mod, "compile_targets", None)
        if not callable(fn):
            problems.append(_problem(where, "has no compile_targets() function"))
            continue
        try:
            listed = list(fn())
        except Exception as e:
            problems.append(_problem(where, f"compile_targets() raised {type(e).__name__}: {e}"))
            continue
        if not listed:
            problems.append(_problem(where, "compile_targets() returned no targets"))
        for i, t in enumerate(listed):
            missing = [k for k in _REQUIRED_KEYS if not isinstance(t, dict) or k not in t]
            if missing:
                problems.append(_problem(f"{where}[{i}]", f"target lacks keys {missing}"))
            else:
                targets.append((name, t))
    return targets, problems


def _signature(t: dict) -> tuple[dict, dict, dict]:
    """Full signature (constexprs included), constexprs and divisibility attributes for ASTSource."""
    fn = t["fn"]
    constexprs = dict(t["constexprs"])
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in t["signature"]:
            sig[name] = t["signature"][name]
        else:
            raise ValueError(f"argument {name!r} has neither a type in 'signature' nor a value in 'constexprs'")
    unknown = sorted((set(t["signature"]) | set(constexprs)) - set(fn.arg_names))
    if unknown:
        raise ValueError(f"{unknown} are not arguments of {fn.__name__}")
    aligned = set(t.get("divisible_by_16", ()))
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if sig[name] != "constexpr" and (sig[name].startswith("*") or name in aligned)
    }
    return sig, constexprs, attrs


def _binary_resources(cubin: bytes) -> tuple[int | None, int | None, str]:
    """(registers, stack frame bytes, cuobjdump's text) of the binary Triton built: the one
    that launches, with whatever options Triton's own ptxas run added."""
    from triton.tools.disasm import path_to_cuobjdump

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        proc = subprocess.run([path_to_cuobjdump(), "-res-usage", path], capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    usage = re.search(r"REG:(\d+) STACK:(\d+)", log)
    return (int(usage.group(1)), int(usage.group(2)), log) if usage else (None, None, log)


def _tensor_core_dots(ttgir: str, cap: int, mma_sync_ok: bool = False) -> tuple[int, int]:
    """(number of dots, number lowered to the architecture's tensor-core instruction: wgmma on
    sm_90, or mma.sync too when ``mma_sync_ok``; mma.sync below)."""
    mma_v2 = set(re.findall(r"^(#\w+) = #ttg\.nvidia_mma<\{versionMajor = 2", ttgir, re.M))
    wgmma = len(re.findall(r"= ttng\.warp_group_dot ", ttgir))
    plain = re.findall(r"= tt\.dot .*-> tensor<[^,>]*, (#\w+)>", ttgir)
    v2 = sum(1 for enc in plain if enc in mma_v2)
    if cap >= 90:
        return wgmma + len(plain), wgmma + (v2 if mma_sync_ok else 0)
    return wgmma + len(plain), v2


_SASS_INSTRUCTION = re.compile(r"^[\w-]+:[\w-]+:[\w-]+:[\w-]+:\w+\s+(.+?);?\s*$")
_SASS_LABEL = re.compile(r"^(\.?L\w+):\s*$")
_SASS_BRANCH = re.compile(r"\bBRA\s+(?:\S+\s+)?`?\(?(\.?L\w+)\)?")
_SASS_PREDICATE = re.compile(r"^@!?U?P(?:\d|T)\s+")  # @P0, @!P1, @UP0, @!PT
_TENSOR_CORE_SASS = ("HGMMA", "HMMA", "IMMA")


def sass_loops(sass: str) -> list[list[str]]:
    """The innermost loops of a kernel's SASS (cuobjdump's text), in program order: for each
    backward branch whose target label encloses no other loop, the instructions from the
    label to the branch, inclusive."""
    instructions, labels, loops = [], {}, []
    for line in sass.splitlines():
        line = line.strip()
        label = _SASS_LABEL.match(line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        match = _SASS_INSTRUCTION.match(line)
        if not match:
            continue
        instructions.append(match.group(1))
        branch = _SASS_BRANCH.search(match.group(1))
        if branch and branch.group(1) in labels:  # a label already seen: a backward branch
            loops.append((labels[branch.group(1)], len(instructions)))
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return [instructions[a:b] for a, b in sorted(innermost)]


def _matmul_loops(sass: str) -> list[list[str]]:
    """The innermost loops that issue the most tensor-core instructions, shortest first (the
    first of equals first)."""
    counted = [(sum(_SASS_PREDICATE.sub("", op).startswith(_TENSOR_CORE_SASS) for op in loop), i, loop)
               for i, loop in enumerate(sass_loops(sass))]
    most = max((c for c, _, _ in counted), default=0)
    return [loop for _, _, loop in sorted((len(loop), i, loop) for c, i, loop in counted if most and c == most)]


def main_loop(sass: str) -> list[str] | None:
    """The innermost loop that issues the most tensor-core instructions, and of several such
    the shortest, the first of equals (None without one): a kernel's matmul loop over full
    tiles, not its copy with per-element masks nor a lighter loop before it."""
    loops = _matmul_loops(sass)
    return loops[0] if loops else None


def partial_loop(sass: str) -> list[str] | None:
    """The second of :func:`main_loop`'s order (None without one): with a dense mask, the
    attention kernels' loop over the tiles whose mask they read (the main loop being the one
    over tiles that need none)."""
    loops = _matmul_loops(sass)
    return loops[1] if len(loops) > 1 else None


def _loop_metrics(kernel, t: dict, cap: int) -> dict:
    """tma, wgmma_shapes and loop_per_element of a compiled kernel (see the module docstring)."""
    ptx = kernel.asm["ptx"]
    shapes = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
    metrics = dict(tma=cap >= 90 and "cp.async.bulk.tensor" in ptx, wgmma_shapes=" ".join(shapes) or None,
                   loop_per_element=None, partial_loop_per_element=None)
    if t.get("loop_scores"):
        per_element = 32 * t["num_warps"] / t["loop_scores"]
        loop = main_loop(kernel.asm["sass"])
        if loop is not None:
            metrics["loop_per_element"] = round(len(loop) * per_element, 2)
        loop = partial_loop(kernel.asm["sass"]) if t.get("partial_loop") else None
        if loop is not None:
            metrics["partial_loop_per_element"] = round(len(loop) * per_element, 2)
    return metrics


def _build(module: str, t: dict, arch: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fasttrans.kernels import LAUNCH_OPTIONS

    cap = ARCHS[arch]
    row = dict(kernel=t["kernel"], config=t["config"], arch=arch, ok=False, registers=None, spills=None,
               shared_bytes=None, tensor_cores=None, tma=None, wgmma_shapes=None, loop_per_element=None,
               partial_loop_per_element=None, error=None)
    start = time.perf_counter()
    try:
        sig, constexprs, attrs = _signature(t)
        kernel = triton.compile(
            ASTSource(fn=t["fn"], signature=sig, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", cap, 32),
            options={"num_warps": t["num_warps"], "num_stages": t["num_stages"], **LAUNCH_OPTIONS},
        )
    except Exception as e:
        row["error"] = f"compilation failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''}"
        row["seconds"] = round(time.perf_counter() - start, 2)
        return row
    ptx = kernel.asm["ptx"]
    row["shared_bytes"] = int(kernel.metadata.shared)
    row["registers"], row["spills"], log = _binary_resources(kernel.asm["cubin"])
    mma_sync_ok = cap >= 90 and not t.get("wgmma", True)
    dots, lowered = _tensor_core_dots(kernel.asm["ttgir"], cap, mma_sync_ok)
    instructions = ("wgmma.mma_async",) if cap >= 90 else ("mma.sync",)
    if mma_sync_ok:
        instructions += ("mma.sync",)
    instruction = " or ".join(instructions)
    if dots:
        row["tensor_cores"] = lowered == dots and any(i in ptx for i in instructions)
    elif t["matmul"]:
        row["tensor_cores"] = False
    disassembly = None
    try:
        row.update(_loop_metrics(kernel, t, cap))
    except Exception as e:  # no disassembler: the counts stay missing, which fails only a loop goal
        disassembly = f"could not disassemble: {type(e).__name__}: {e}"
    problems = []
    goal = t.get("loop_goal") if cap >= 90 else None
    if goal is not None:
        if row["loop_per_element"] is None:
            problems.append(disassembly or "no main loop with tensor-core instructions found in the SASS")
        elif row["loop_per_element"] > goal:
            problems.append(f"main loop: {row['loop_per_element']} SASS instructions per score element > {goal}")
    if row["registers"] is None or row["spills"] is None:
        problems.append(f"could not read the binary's resource usage: {log.strip()[-300:]}")
    elif row["spills"]:
        problems.append(f"register spills: a {row['spills']}-byte stack frame")
    if row["shared_bytes"] > SHARED_LIMIT[cap]:
        problems.append(f"{row['shared_bytes']} bytes of shared memory > the {SHARED_LIMIT[cap]} available on {arch}")
    if t["matmul"] and not row["tensor_cores"]:
        problems.append(f"{lowered} of {dots} matmuls lowered to {instruction}")
    row["ok"] = not problems
    row["error"] = "; ".join(problems) or disassembly  # a missing count alone is reported, not failed
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _worker(spec: dict) -> list[dict]:
    """Builds shard ``spec['shard']`` of ``spec['jobs']`` of every (target, arch) pair."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile-check workers must run without TRITON_INTERPRET")
    targets, problems = _collect(spec["modules"])
    pattern = spec.get("kernel")
    builds = [(m, t, arch) for m, t in targets for arch in spec["archs"]
              if (not pattern or pattern in t["kernel"]) and arch in t.get("archs", ARCHS)]
    rows = [dict(r, index=-1) for r in problems] if spec["shard"] == 0 else []
    for index in range(spec["shard"], len(builds), spec["jobs"]):
        rows.append(dict(_build(*builds[index]), index=index))
    return rows


# --------------------------------------------------------------------------------------
# Driver side
# --------------------------------------------------------------------------------------
def _worker_env() -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    # keep Triton's current default (fused multiply-add on) without its deprecation warning
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    # the workers resolve fasttrans exactly as this process does (editable installs, pytest paths)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def run(archs: list[str], jobs: int = 2, kernel: str | None = None, modules: list[str] | None = None) -> list[dict]:
    """Compile everything in ``jobs`` worker processes; one result row per build (or problem)."""
    modules = modules or _module_names()
    procs = []
    for shard in range(jobs):
        spec = dict(archs=archs, jobs=jobs, shard=shard, kernel=kernel, modules=modules)
        code = ("import json, sys; from fasttrans.compile_check import _worker; "
                "print(json.dumps(_worker(json.loads(sys.argv[1]))))")
        procs.append(subprocess.Popen([sys.executable, "-c", code, json.dumps(spec)], env=_worker_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    rows = []
    for shard, proc in enumerate(procs):
        out, err = proc.communicate()
        try:
            rows.extend(json.loads(out.strip().splitlines()[-1]))
        except (json.JSONDecodeError, IndexError):
            tail = (err or out).strip()[-1500:]
            rows.append(dict(_problem("compile-check worker", f"worker {shard} failed (exit {proc.returncode}): {tail}"),
                             index=-1))
    return sorted(rows, key=lambda r: r["index"])  # the order of compile_targets(), architectures innermost


def _format_table(rows: list[dict], seconds: float) -> str:
    def cell(v):
        return "-" if v is None else ("yes" if v is True else "no" if v is False else str(v))

    header = ("kernel", "config", "arch", "ok", "regs", "spills", "shared", "tensor cores", "tma", "wgmma",
              "loop/elem", "partial/elem")
    table = [header] + [
        (r["kernel"], r["config"], r["arch"], "ok" if r["ok"] else "FAIL", cell(r["registers"]),
         cell(r["spills"]), cell(r["shared_bytes"]), cell(r["tensor_cores"]), cell(r.get("tma")),
         cell(r.get("wgmma_shapes")), cell(r.get("loop_per_element")), cell(r.get("partial_loop_per_element")))
        for r in rows
    ]
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(line, widths)).rstrip() for line in table]
    failed = [r for r in rows if not r["ok"]]
    lines.append("")
    for r in failed:
        lines.append(f"FAIL {r['kernel']} [{r['config']}] {r['arch']}: {r['error']}")
    lines.append(f"{len(rows)} builds, {len(failed)} failed, {seconds:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fasttrans compile-check",
        description="Compile every Triton kernel and shipped launch configuration for sm_80/sm_90 (no GPU "
                    "needed) and report registers, spills, shared memory, tensor-core use, TMA and the main "
                    "loop's SASS instructions per score element.",
    )
    parser.add_argument("--arch", default="sm_80,sm_90",
                        help="comma-separated target architectures (default: sm_80,sm_90)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of result objects")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                        help="parallel worker processes (default: min(4, CPU count))")
    parser.add_argument("--kernel", default=None, help="only kernels whose name contains this string")
    parser.add_argument("--module", action="append", default=None,
                        help="only this kernels module (e.g. attention; repeatable; default: all of kernels/)")
    args = parser.parse_args(argv)

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    bad = [a for a in archs if a not in ARCHS]
    if bad or not archs:
        parser.error(f"--arch: expected a comma-separated subset of {', '.join(ARCHS)}, got {args.arch!r}")
    if args.jobs < 1:
        parser.error(f"--jobs: expected a positive integer, got {args.jobs}")

    start = time.perf_counter()
    rows = run(archs, jobs=args.jobs, kernel=args.kernel, modules=args.module)
    if args.json:
        print(json.dumps([{k: r.get(k) for k in _RESULT_KEYS} for r in rows], indent=1))
    else:
        print(_format_table(rows, time.perf_counter() - start))
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
