"""Just-in-time build of the C++ kernels with ``torch.utils.cpp_extension.load_inline``, cached per machine.

The sources (``common.h``, ``attention.cpp``, ``append.cpp``, ``bindings.cpp``, concatenated in that order) are built
once into ``cache_dir()/cpu_kernels/<name>`` (``flashcodec_fx.pretrained.cache_dir``: ``$FLASHCODEC_CACHE``, else
``$XDG_CACHE_HOME/flashcodec_fx``, else ``~/.cache/flashcodec_fx``), about 30 s, on the first call of a kernel.
The name hashes the sources, the flags, the torch and Python versions and the CPU's instruction-set flags, since the
build uses ``-march=native``: a cache folder shared by different machines holds one build per kind of CPU. When the
build fails (no C++ compiler, no ninja), one warning says why and the kernels run the reference ops instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from ...pretrained import cache_dir

SOURCES = ("common.h", "attention.cpp", "append.cpp", "bindings.cpp")
# -ffp-contract=off: every a * b + c rounds as written (the encoder is bitwise the reference); the attention kernel
# asks for its FMAs with std::fma.
# -fvisibility=hidden: the helpers bind locally (no PLT calls between them); the module's entry point stays exported.
CFLAGS = ("-O3", "-fopenmp", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fvisibility=hidden")
LDFLAGS = ("-fopenmp",)
_HERE = Path(__file__).resolve().parent
_LOG = logging.getLogger("flashcodec_fx")


def _cpu_flags() -> str:
    """The CPU's instruction-set flags (what ``-march=native`` compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def source_text(paths: tuple[Path, ...] | None = None) -> str:
    """The sources, concatenated: ``paths`` (default: this folder's :data:`SOURCES`)."""
    return "\n".join(path.read_text() for path in (paths or tuple(_HERE / name for name in SOURCES)))


def build_name(source: str) -> str:
    """``flashcodec_cpu_<hash>``: one build per source, flags, torch, Python and CPU kind."""
    key = "\n".join([source, " ".join(CFLAGS), torch.__version__, sys.version, _cpu_flags()])
    return "flashcodec_cpu_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _with_ninja() -> None:
    """Put the ``ninja`` from PyPI on PATH when the environment's bin folder is not (a venv used without activation)."""
    if shutil.which("ninja"):
        return
    for folder in (Path(sys.executable).parent, _ninja_bin()):
        if folder is not None and (folder / "ninja").exists():
            os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
            return


def _ninja_bin() -> Path | None:
    try:
        import ninja
    except ImportError:
        return None
    return Path(ninja.BIN_DIR)


def compile_extension(paths: tuple[Path, ...] | None = None) -> ModuleType:
    """Build (or load the cached build of) the kernels of ``paths`` (default: :data:`SOURCES`, the cache's ops);
    raises when no build is possible."""
    from torch.utils.cpp_extension import load_inline

    _with_ninja()
    source = source_text(paths)
    name = build_name(source)
    folder = cache_dir() / "cpu_kernels" / name
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / f"{name}.so").exists():
        _LOG.warning("flashcodec_fx: building the CPU kernels once for this machine (about 30 s) in %s", folder)
    return load_inline(name, cpp_sources=[source], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                       build_directory=str(folder), verbose=False)


class Extension:
    """The compiled kernels, built on first use; ``module()`` is None (after one warning) when the build failed."""

    def __init__(self, compile_fn: Callable[[], ModuleType] = compile_extension,
                 kernels: str = "codec_attention and append"):
        self._compile = compile_fn
        self._kernels = kernels
        self._module: ModuleType | None = None
        self._error: str | None = None
        self._lock = threading.Lock()

    @property
    def error(self) -> str | None:
        """Why the build failed (None when it did not, or was not tried yet)."""
        return self._error

    def module(self) -> ModuleType | None:
        if self._module is not None or self._error is not None:
            return self._module
        with self._lock:
            if self._module is None and self._error is None:
                try:
                    self._module = self._compile()
                except Exception as err:  # any build failure: no compiler, no ninja, a compiler error
                    self._error = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
                    warnings.warn(f"flashcodec_fx: the CPU kernels could not be built ({self._error}); "
                                  f"{self._kernels} run the reference ops (slower). Install a C++ compiler "
                                  "and ninja, or set FLASHCODEC_KERNELS=reference to silence this.", RuntimeWarning,
                                  stacklevel=3)
        return self._module


EXTENSION = Extension()
