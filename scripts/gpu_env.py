"""The GPU check's preamble (scripts/gpu_check.sh): print the machine, find the CUDA runtime, stop loudly.

The GPU machine has torch (with its own CUDA 13 runtime under site-packages/nvidia/...) but no TVM; the bundle
carries TVM's runtime only. Its CUDA sidecar ``libtvm_runtime_cuda.so`` needs ``libcudart.so.13``, which the
bundle does not carry, and when it fails to load TVM (and this project's ``pack.load_cuda_runtime``) swallow the
error and go on without CUDA. So, before anything else runs, three steps, each its own command::

    python3 scripts/gpu_env.py env --out OUT/env.txt     # the machine, for a diagnosis from the output alone
    python3 scripts/gpu_env.py cudart                    # prints the folder holding libcudart.so.13 (exit 3: none)
    python3 scripts/gpu_env.py verify --device cuda --pack DIR --site DIR
        # exit 0: the sidecar loaded, its global functions exist, tvm.cuda(0).exist, every pack file loads;
        # else a FATAL line per problem (every pack file is tried, all failures listed) and exit 3 or 4.

``GPU_ENV_CUDART_DIRS`` (a colon-separated list) replaces the search path for ``cudart``: tests point it at an
empty or fake folder to prove the failure is loud. Exit codes: 0 fine, 3 environment (runtime, driver, device),
4 a kernel pack that does not load.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import pathlib
import platform
import shutil
import site
import subprocess
import sys

CUDART = "libcudart.so.13"
# what libtvm_runtime_cuda.so registers when it loads: the module loaders and the device API
SIDECAR_FUNCS = ("ffi.Module.create.cuda", "ffi.Module.load_from_bytes.cuda", "device_api.cuda")
EXIT_ENV, EXIT_PACK = 3, 4


def fatal(msg: str, code: int) -> None:
    """One clear line on stderr (gpu_check.sh logs both streams), then exit ``code``."""
    sys.stdout.flush()
    print(f"gpu_env: FATAL: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def _cmd(args: list[str], timeout: float = 20) -> str:
    """A command's output (first 40 lines), or why there is none: never raises, never hangs past timeout."""
    if shutil.which(args[0]) is None:
        return f"({args[0]}: not on PATH)"
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"({' '.join(args)}: timed out after {timeout:.0f} s)"
    text = (p.stdout + p.stderr).strip()
    lines = text.splitlines()
    tail = f"\n... ({len(lines) - 40} more lines)" if len(lines) > 40 else ""
    return "\n".join(lines[:40]) + tail + ("" if p.returncode == 0 else f"\n(exit {p.returncode})")


def runtime_kind() -> str:
    """The sandbox the machine runs in: gVisor reports kernel 4.4.0; this workplace's Firecracker kernels carry
    '-fc-' in their release (compute-sanitizer and ncu worked on Firecracker only, KINDS.md)."""
    release = platform.release()
    try:
        version = open("/proc/version").read().strip()
    except OSError:
        version = ""
    if "-fc-" in release or "firecracker" in version.lower():
        return f"firecracker (kernel {release})"
    if release.startswith("4.4.0") or "gvisor" in version.lower():
        return f"gvisor (kernel {release}: compute-sanitizer and ncu are not expected to work)"
    return f"other (kernel {release})"


def _torch_lines() -> list[str]:
    """torch, its CUDA, the device, Triton and the upstream's Python dependencies, as this Python sees them."""
    lines = []
    try:
        import torch
    except Exception as err:  # noqa: BLE001 - reported, not fatal here
        return [f"torch: cannot import ({type(err).__name__}: {err})"]
    lines.append(f"torch: {torch.__version__} (CUDA {torch.version.cuda}) at {os.path.dirname(torch.__file__)}")
    try:
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            lines.append(f"device: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                         f"{p.total_memory / 2**30:.1f} GiB, {torch.cuda.device_count()} device(s)")
        else:
            lines.append("device: torch.cuda.is_available() is False")
    except Exception as err:  # noqa: BLE001
        lines.append(f"device: error {type(err).__name__}: {err}")
    for name in ("triton", "einops", "transformers", "numpy"):
        try:
            mod = __import__(name)
            lines.append(f"{name}: {getattr(mod, '__version__', '?')}")
        except Exception as err:  # noqa: BLE001
            lines.append(f"{name}: not importable ({type(err).__name__})")
    return lines


def cmd_env(args) -> int:
    """Write the environment report to ``args.out`` and stdout. Never fails: it is the diagnosis."""
    sections = [
        ("python", [f"{sys.version.split()[0]} at {sys.executable}"]),
        ("host", [f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
                  f"runtime: {runtime_kind()}", f"uname: {' '.join(platform.uname())}"]),
        ("torch", _torch_lines()),
        ("nvidia-smi", [_cmd(["nvidia-smi"])]),
        ("driver", [_cmd(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"])]),
        ("compute-sanitizer", [_cmd(["compute-sanitizer", "--version"])]),
        ("nvcc", [_cmd(["nvcc", "--version"])]),
        ("variables", [f"{k}={os.environ.get(k, '')}" for k in
                       ("LD_LIBRARY_PATH", "CUDA_HOME", "PYTHONPATH", "TVM_USE_RUNTIME_LIB", "GPU_CHECK_DEVICE")]),
    ]
    text = "\n".join(f"## {title}\n" + "\n".join(body) for title, body in sections) + "\n"
    print(text, end="", flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    return 0


def cudart_candidates() -> list[str]:
    """Folders that may hold libcudart.so.13, in search order: $GPU_ENV_CUDART_DIRS alone if set; else torch's
    nvidia wheels (nvidia/cu13/lib, nvidia/cuda_runtime/lib, any nvidia/*/lib) in every site folder, torch/lib,
    the loader cache (ldconfig -p), $CUDA_HOME and /usr/local/cuda."""
    forced = os.environ.get("GPU_ENV_CUDART_DIRS")
    if forced is not None:
        return [d for d in forced.split(os.pathsep) if d]
    roots = list(dict.fromkeys([*site.getsitepackages(), site.getusersitepackages(), *sys.path]))
    dirs = []
    for root in filter(os.path.isdir, roots):
        for pattern in ("nvidia/cu13/lib", "nvidia/cuda_runtime/lib", "nvidia/*/lib", "torch/lib"):
            dirs.extend(sorted(glob.glob(os.path.join(root, pattern))))
    ldc = _cmd(["ldconfig", "-p"], timeout=10) if shutil.which("ldconfig") or os.path.exists("/sbin/ldconfig") \
        else ""
    dirs.extend(os.path.dirname(line.split("=>")[-1].strip()) for line in ldc.splitlines() if CUDART in line)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            dirs.extend([os.path.join(home, "lib64"), os.path.join(home, "lib")])
    return list(dict.fromkeys(dirs))


def find_cudart() -> str | None:
    """The first candidate folder whose libcudart.so.13 actually loads (a present but broken file is skipped)."""
    for d in cudart_candidates():
        path = os.path.join(d, CUDART)
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as err:
                print(f"gpu_env: {path} does not load ({err}); trying the next folder", file=sys.stderr)
                continue
            return d
    return None


def cmd_cudart(args) -> int:
    """Print the folder holding a loadable libcudart.so.13 (for LD_LIBRARY_PATH), or stop loudly."""
    found = find_cudart()
    if found is None:
        fatal(f"{CUDART} (needed by TVM's CUDA sidecar libtvm_runtime_cuda.so) was not found in any of: "
              f"{cudart_candidates() or '(no folders)'}; install torch's nvidia-cuda-runtime or set CUDA_HOME",
              EXIT_ENV)
    print(found)
    return 0


def _check_tvm(site_dir: str | None):
    """Import the bundle's runtime-only tvm (not an installed one with a compiler), or stop loudly."""
    try:
        import tvm
        import tvm.base
        import tvm_ffi
    except Exception as err:  # noqa: BLE001 - any import failure is the message
        fatal(f"import tvm failed: {type(err).__name__}: {err}", EXIT_ENV)
    if not tvm.base._RUNTIME_ONLY:
        fatal(f"tvm at {tvm.__file__} loaded its compiler: set TVM_USE_RUNTIME_LIB=1 (the GPU machine has none)",
              EXIT_ENV)
    if site_dir and not os.path.realpath(tvm.__file__).startswith(os.path.realpath(site_dir) + os.sep):
        fatal(f"tvm was imported from {tvm.__file__}, not from the bundle's {site_dir} (PYTHONPATH order?)", EXIT_ENV)
    print(f"gpu_env: tvm {tvm.__version__} runtime only from {os.path.dirname(tvm.__file__)}, "
          f"tvm-ffi {tvm_ffi.__version__}")
    return tvm, tvm_ffi


def _check_cuda(tvm, tvm_ffi) -> str:
    """Load TVM's CUDA sidecar with its error shown (TVM itself swallows it), check what it registers and that
    the device exists. Returns the device's arch, e.g. 'sm_90'."""
    import tvm_ffi.libinfo
    from tvm.base import _LOADED_LIBS

    cudart = find_cudart()
    if cudart is None:
        fatal(f"{CUDART} not found in any of {cudart_candidates()} (TVM's CUDA sidecar needs it)", EXIT_ENV)
    print(f"gpu_env: {CUDART} from {cudart}")
    lib_dir = pathlib.Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent
    try:
        _LOADED_LIBS["tvm_runtime_cuda"] = tvm_ffi.libinfo.load_lib_ctypes(
            package="tvm", target_name="tvm_runtime_cuda", extra_lib_paths=[lib_dir], mode="RTLD_LOCAL")
    except Exception as err:  # noqa: BLE001 - the point: show what TVM hides
        fatal(f"TVM's CUDA sidecar libtvm_runtime_cuda.so (in {lib_dir}) failed to load: "
              f"{type(err).__name__}: {err}", EXIT_ENV)
    missing = [f for f in SIDECAR_FUNCS if tvm_ffi.get_global_func(f, allow_missing=True) is None]
    if missing:
        fatal(f"the CUDA sidecar loaded but did not register {missing}", EXIT_ENV)
    dev = tvm.cuda(0)
    if not dev.exist:
        fatal("tvm.cuda(0).exist is False: the CUDA runtime loaded but sees no device (driver? "
              "CUDA_VISIBLE_DEVICES? see nvidia-smi above)", EXIT_ENV)
    arch = "sm_" + dev.compute_version.replace(".", "")
    print(f"gpu_env: CUDA sidecar loaded ({', '.join(SIDECAR_FUNCS)}); tvm.cuda(0): {dev.device_name}, {arch}")
    return arch


def _check_pack(tvm, folder: str, want_target: str) -> None:
    """Load every file the pack's manifest names (all of them, failures collected); stop if any fails or the
    pack was built for another target (``want_target``: 'cuda-sm_90', or 'llvm' for any CPU pack)."""
    path = os.path.join(folder, "manifest.json")
    try:
        manifest = json.load(open(path))
    except (OSError, ValueError) as err:
        fatal(f"kernel pack {folder}: cannot read its manifest ({type(err).__name__}: {err})", EXIT_PACK)
    target = manifest.get("target", "?")
    if not (target == want_target or (want_target == "llvm" and target.startswith("llvm"))):
        fatal(f"kernel pack {folder} was built for {target}, this device needs {want_target}", EXIT_PACK)
    files = sorted({e["file"] for e in manifest.get("entries", [])})
    if not files:
        fatal(f"kernel pack {folder}: its manifest lists no kernels", EXIT_PACK)
    failures = []
    for name in files:
        try:
            tvm.runtime.load_module(os.path.join(folder, name))
        except Exception as err:  # noqa: BLE001 - collect every failure, report them together
            failures.append(f"{name}: {type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}")
    for line in failures:
        print(f"gpu_env: pack file failed to load: {line}")
    if failures:
        fatal(f"{len(failures)} of {len(files)} files of kernel pack {folder} failed to load (listed above)",
              EXIT_PACK)
    print(f"gpu_env: kernel pack {folder} ({target}): all {len(files)} files load, "
          f"{len(manifest['entries'])} entries")


def cmd_verify(args) -> int:
    """Runtime-only tvm from the bundle, the CUDA sidecar and device (``--device cuda``), every pack file."""
    tvm, tvm_ffi = _check_tvm(args.site)
    if args.device == "cuda":
        want = "cuda-" + _check_cuda(tvm, tvm_ffi)
    else:
        if not tvm.cpu(0).exist:
            fatal("tvm.cpu(0).exist is False", EXIT_ENV)
        want = "llvm"
    for folder in args.pack:
        _check_pack(tvm, folder, want)
    print("gpu_env: verify passed")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    env = sub.add_parser("env", help="print the environment (and append it to --out)")
    env.add_argument("--out")
    sub.add_parser("cudart", help=f"print the folder holding a loadable {CUDART}")
    ver = sub.add_parser("verify", help="runtime-only tvm, CUDA sidecar and device, every pack file loads")
    ver.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ver.add_argument("--pack", action="append", default=[], help="a kernel pack folder (repeatable)")
    ver.add_argument("--site", help="the bundle's site folder tvm must be imported from")
    args = ap.parse_args(argv)
    return {"env": cmd_env, "cudart": cmd_cudart, "verify": cmd_verify}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
