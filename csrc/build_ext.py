"""Decide whether and how setup.py builds ``dearopt.backends._nccl`` (csrc/nccl_comm.cpp).

``configure()`` returns ``(ext_modules, cmdclass)``:

* ``DEAROPT_WITH_NCCL=0``: nothing is built.
* ``DEAROPT_WITH_NCCL=1``: the extension is built, and any missing piece (nvcc /
  the CUDA toolkit, NCCL headers or library, pybind11) or a failed compile
  stops the installation with an error.
* unset: built when the CUDA toolkit (found through ``CUDA_HOME``,
  ``CUDA_PATH`` or ``nvcc`` on ``PATH``) and NCCL (``NCCL_HOME``, the
  ``nvidia-nccl-cu13``/``-cu12`` pip package, or ``/usr/include/nccl.h``) are
  found; otherwise dearopt installs as pure Python and one line says why.

The module is compiled by the ordinary C++ compiler with the CUDA runtime and
NCCL headers; it needs no torch headers.  It links the static CUDA runtime and
``libnccl.so.2`` with an rpath to the NCCL library directory (``$ORIGIN``
relative for a wheel installed next to the pip package, plus the absolute path
found at build time for editable installs).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from typing import Dict, List, Optional, Tuple

ENV = "DEAROPT_WITH_NCCL"
SOURCE = os.path.join("csrc", "nccl_comm.cpp")
_BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "install", "develop", "bdist_egg"}


def _mode() -> str:
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("1", "true", "yes", "on", "force"):
        return "force"
    if raw in ("0", "false", "no", "off"):
        return "off"
    return "auto"


def _say(message: str) -> None:
    # One line, only for commands that build (setup.py also runs for metadata).
    if any(arg in _BUILD_COMMANDS for arg in sys.argv[1:]):
        print(f"dearopt: {message}", file=sys.stderr, flush=True)


def _has_cuda_headers(home: str) -> bool:
    return os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h"))


def find_cuda() -> Tuple[Optional[Dict[str, str]], str]:
    """Return ({'home', 'nvcc', 'include', 'lib'}, '') or (None, why)."""
    nvcc = None
    homes = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            candidate = os.path.join(home, "bin", "nvcc")
            if os.path.isfile(candidate):
                nvcc = nvcc or candidate
                homes.append(home)
    on_path = shutil.which("nvcc")
    if on_path:
        nvcc = nvcc or on_path
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(on_path))))
        if not any(_has_cuda_headers(h) for h in homes):
            # nvcc may be a wrapper script: ask it where its toolkit is
            try:
                out = subprocess.run(
                    [on_path, "--dryrun", "-x", "cu", os.devnull], capture_output=True, text=True, timeout=30
                )
                match = re.search(r"TOP=(\S+)", out.stdout + out.stderr)
                if match:
                    homes.append(os.path.normpath(match.group(1)))
            except (OSError, subprocess.SubprocessError):
                pass
    if nvcc is None:
        return None, "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    homes.append("/usr/local/cuda")
    for home in homes:
        if not _has_cuda_headers(home):
            continue
        for libdir in (
            "lib64",
            "lib",
            os.path.join("targets", "x86_64-linux", "lib"),
            os.path.join("targets", "sbsa-linux", "lib"),
        ):
            lib = os.path.join(home, libdir)
            if os.path.isfile(os.path.join(lib, "libcudart_static.a")):
                return {"home": home, "nvcc": nvcc, "include": os.path.join(home, "include"), "lib": lib}, ""
        return None, f"the CUDA toolkit at {home} has no libcudart_static.a"
    return None, f"nvcc found at {nvcc} but no CUDA toolkit headers (cuda_runtime_api.h) next to it; set CUDA_HOME"


def _nccl_lib_in(directory: str) -> Optional[str]:
    if os.path.isfile(os.path.join(directory, "libnccl.so.2")) or os.path.isfile(os.path.join(directory, "libnccl.so")):
        return directory
    return None


def find_nccl() -> Tuple[Optional[Dict[str, str]], str]:
    """Return ({'include', 'lib', 'rpath_origin'}, '') or (None, why)."""
    home = os.environ.get("NCCL_HOME") or os.environ.get("NCCL_ROOT")
    if home:
        include = os.path.join(home, "include")
        lib = next((d for d in (os.path.join(home, "lib"), os.path.join(home, "lib64")) if _nccl_lib_in(d)), None)
        if os.path.isfile(os.path.join(include, "nccl.h")) and lib:
            return {"include": include, "lib": lib, "rpath_origin": ""}, ""
        return None, f"NCCL_HOME={home} has no include/nccl.h with lib/libnccl.so.2"
    # the nvidia-nccl-cu13 / -cu12 pip package (a namespace package: nvidia/nccl)
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        include, lib = os.path.join(location, "include"), os.path.join(location, "lib")
        if os.path.isfile(os.path.join(include, "nccl.h")) and _nccl_lib_in(lib):
            # dearopt/backends/_nccl*.so and nvidia/nccl/lib in the same site-packages
            return {"include": include, "lib": lib, "rpath_origin": "$ORIGIN/../../nvidia/nccl/lib"}, ""
    if os.path.isfile("/usr/include/nccl.h"):
        multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
        for lib in (f"/usr/lib/{multiarch}", "/usr/lib64", "/usr/lib"):
            if _nccl_lib_in(lib):
                return {"include": "/usr/include", "lib": lib, "rpath_origin": ""}, ""
        return None, "/usr/include/nccl.h found but no libnccl.so.2 next to it"
    return None, "NCCL not found (pip install nvidia-nccl-cu13, or set NCCL_HOME)"


def find_pybind11() -> Tuple[Optional[str], str]:
    try:
        import pybind11
    except ImportError:
        return None, "pybind11 is not installed in the build environment (pip install pybind11)"
    return pybind11.get_include(), ""


def _make_cmdclass(forced):
    """A build_ext that builds each extension on its own (torch's BuildExtension where torch is importable, for
    ``dearopt.engine._ready``); one not in ``forced`` whose build fails is left out with one line saying why."""
    try:
        from torch.utils.cpp_extension import BuildExtension as base
    except ImportError:
        from setuptools.command.build_ext import build_ext as base

    class BuildExt(base):
        """Builds dearopt.backends._nccl and dearopt.engine._ready; in auto mode a failed build keeps Python."""

        def build_extension(self, ext):
            start = time.monotonic()
            try:
                super().build_extension(ext)
            except Exception as exc:  # CompileError, LinkError, OSError, ...
                if ext.name in forced:
                    raise
                env = ENV if ext.name == "dearopt.backends._nccl" else READY_ENV
                print(
                    f"dearopt: {ext.name} skipped: its build failed ({type(exc).__name__}: "
                    f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}); "
                    f"set {env}=1 to make this an error",
                    file=sys.stderr,
                    flush=True,
                )
                return
            print(f"dearopt: built {ext.name} in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)

    if hasattr(BuildExt, "with_options"):  # torch's: no ninja needed, one file per extension
        return {"build_ext": BuildExt.with_options(use_ninja=False)}
    return {"build_ext": BuildExt}


READY_ENV = "DEAROPT_WITH_READY"
READY_SOURCE = os.path.join("csrc", "ready.cpp")


def _ready_extension(forced: bool):
    """``dearopt.engine._ready`` (csrc/ready.cpp): the gradient-ready hooks and forward gates in C++ (torch's
    headers; built on CPU as well as CUDA machines), or None where torch's C++ extension tools are missing."""
    try:
        from torch.utils.cpp_extension import CppExtension
    except ImportError as exc:
        if forced:
            sys.exit(f"error: {READY_ENV}=1 but torch's C++ extension tools are not importable: {exc}")
        _say(f"ready-hooks extension skipped (the engine's Python hooks are used): {exc}")
        return None
    return CppExtension(
        "dearopt.engine._ready",
        sources=[READY_SOURCE],
        extra_compile_args=["-O2", "-g0", "-fvisibility=hidden"],
    )


def _ready_mode() -> str:
    raw = os.environ.get(READY_ENV, "").strip().lower()
    if raw in ("1", "true", "yes", "on", "force"):
        return "force"
    if raw in ("0", "false", "no", "off"):
        return "off"
    return "auto"


def configure() -> Tuple[List, Dict]:
    """The extension modules and cmdclass for setup(): the NCCL extension where it can be built (:func:`_nccl_config`)
    and the ready-hooks extension (``DEAROPT_WITH_READY``: ``1`` forces it, ``0`` skips it; by default built where
    torch's C++ extension tools work, its failure leaving the engine's Python hooks)."""
    exts, forced = [], set()
    nccl = _nccl_config()
    if nccl is not None:
        exts.append(nccl[0])
        if nccl[1]:
            forced.add(nccl[0].name)
    ready_mode = _ready_mode()
    if ready_mode != "off":
        ready = _ready_extension(ready_mode == "force")
        if ready is not None:
            exts.append(ready)
            if ready_mode == "force":
                forced.add(ready.name)
    else:
        _say(f"ready-hooks extension skipped: {READY_ENV}=0")
    if not exts:
        return [], {}
    return exts, _make_cmdclass(forced)


def _nccl_config():
    """``(extension, forced)`` for ``dearopt.backends._nccl``, or None when it is not built."""
    mode = _mode()
    if mode == "off":
        _say(f"NCCL extension skipped: {ENV}=0")
        return None
    cuda, why_cuda = find_cuda()
    nccl, why_nccl = find_nccl()
    pybind_include, why_pybind = find_pybind11()
    missing = [why for why in (why_cuda, why_nccl, why_pybind) if why]
    if not sys.platform.startswith("linux"):
        missing.append(f"the NCCL extension builds on Linux only (this is {sys.platform})")
    if missing:
        if mode == "force":
            sys.exit(f"error: {ENV}=1 but the NCCL extension cannot be built: " + "; ".join(missing))
        _say("NCCL extension skipped (pure-Python install): " + "; ".join(missing))
        return None

    from setuptools import Extension

    rpaths = [nccl["rpath_origin"]] if nccl["rpath_origin"] else []
    rpaths.append(os.path.realpath(nccl["lib"]))
    link_args = [os.path.join(cuda["lib"], "libcudart_static.a")]
    link_args += [
        f"-L{nccl['lib']}",
        "-l:libnccl.so.2" if os.path.isfile(os.path.join(nccl["lib"], "libnccl.so.2")) else "-lnccl",
    ]
    link_args += [f"-Wl,-rpath,{path}" for path in rpaths]
    link_args += ["-lpthread", "-ldl", "-lrt"]
    ext = Extension(
        "dearopt.backends._nccl",
        sources=[SOURCE],
        include_dirs=[pybind_include, cuda["include"], nccl["include"]],
        extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", "-g0"],
        extra_link_args=link_args,
        depends=glob.glob(os.path.join("csrc", "*.h")),
        language="c++",
    )
    _say(f"building the NCCL extension (CUDA {cuda['home']}, NCCL {nccl['include']})")
    return ext, mode == "force"
