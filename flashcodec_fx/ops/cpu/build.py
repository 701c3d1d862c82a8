"""Just-in-time build of the C++ kernels, once per kind of binary, shared by every environment that can load it.

The sources (the header generated from the layout's Python declarations, ``layout.header()``, then
:data:`SOURCES`, concatenated in that order) are compiled with ``torch.utils.cpp_extension.load_inline`` into
``cache_dir()/cpu_kernels/<name>/<name>.so`` (``flashcodec_fx.pretrained.cache_dir``: ``$FLASHCODEC_CACHE``, else
``$XDG_CACHE_HOME/flashcodec_fx``, else ``~/.cache/flashcodec_fx``). ``<name>`` hashes what the binary depends on
(:func:`build_key`): the sources (the generated header included), the compiler flags, the compiler, torch's version
and C++ ABI, Python's extension ABI and the CPU's instruction-set flags (the build uses ``-march=native``), never a
path of the environment, so two virtual environments with the same torch share one build. A binary that exists is
loaded as it is (no ninja run, no rebuild); a missing one is built under a file lock (a second process waits and then
loads the first one's binary), in a scratch folder, and published by an atomic rename, so a reader never sees half a
file. Every build says so on stderr (``BUILDING``). When the build fails (no C++ compiler, no ninja), one warning says
why and the kernels run the reference ops instead.

Instruction sets: x86-64 builds with ``-march=native`` (``-mprefer-vector-width=512`` too where the CPU has
AVX-512), AArch64 with ``-mcpu=native``, anything else with neither; the kernels pick their SIMD code from the
compiler's own macros (``__AVX2__``, ``__FMA__``; ``token_simd.h``) and fall back to portable C++, so the flags never
claim an instruction the CPU lacks.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from ...pretrained import cache_dir
from .layout import header

try:
    import fcntl
except ImportError:  # not POSIX: builds are still published atomically, two processes may both build
    fcntl = None

SOURCES = ("common.h", "trellis.h", "pool.h", "token_simd.h", "token_attention.cpp", "attention.cpp", "quantize.h",
           "append.cpp", "fused.cpp", "bindings.cpp")
# -ffp-contract=off: every a * b + c rounds as written (the encoder is bitwise the reference); the attention kernels
# ask for their FMAs explicitly (std::fma, FMA intrinsics).
# -fvisibility=hidden: the helpers bind locally (no PLT calls between them); the module's entry point stays exported.
BASE_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fvisibility=hidden")
LDFLAGS = ("-fopenmp",)
BUILDING = "flashcodec_fx: building the CPU kernels (once, ~30 s)"
WAITING = "flashcodec_fx: waiting for another process building the CPU kernels"
_HERE = Path(__file__).resolve().parent


def _cpu_flags() -> str:
    """The CPU's instruction-set flags (what ``-march=native`` compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def isa_cflags(machine: str, cpu_flags: str) -> tuple[str, ...]:
    """Compiler flags naming this CPU's instruction sets (the native ones) for ``platform.machine()`` ``machine``."""
    if machine in ("x86_64", "AMD64", "i686", "i386"):
        wide = ("-mprefer-vector-width=512",) if "avx512f" in cpu_flags.split() else ()
        return ("-march=native", *wide)
    if machine in ("aarch64", "arm64"):
        return ("-mcpu=native",)
    return ()


def cflags() -> tuple[str, ...]:
    return BASE_CFLAGS + isa_cflags(platform.machine(), _cpu_flags())


def compiler() -> str:
    return os.environ.get("CXX", "c++")


@functools.cache
def _compiler_version(cxx: str) -> str:
    """The compiler's first ``--version`` line and target (``unavailable`` when it does not run)."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
        target = subprocess.run([cxx, "-dumpmachine"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "unavailable"
    return f"{version.strip().splitlines()[0] if version.strip() else ''} {target.strip()}"


def source_text(paths: tuple[Path, ...] | None = None) -> str:
    """The sources, concatenated: the generated layout header (``common.h`` uses it), then ``paths`` (default: this
    folder's :data:`SOURCES`)."""
    paths = paths or tuple(_HERE / name for name in SOURCES)
    return "\n".join([header(), *(path.read_text() for path in paths)])


def build_key(source: str) -> dict[str, str]:
    """What the binary depends on, and nothing else (no path of the Python environment)."""
    return {
        "sources": hashlib.sha256(source.encode()).hexdigest(),
        "cflags": " ".join(cflags()),
        "ldflags": " ".join(LDFLAGS),
        "compiler": _compiler_version(compiler()),
        "torch": f"{torch.__version__} {torch.version.git_version} cxx11_abi={int(torch.compiled_with_cxx11_abi())}",
        "python": f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}",
        "cpu": f"{platform.machine()} {_cpu_flags()}",
    }


def build_name(source: str) -> str:
    """``flashcodec_cpu_<hash of build_key>``."""
    key = json.dumps(build_key(source), sort_keys=True)
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


def load_binary(name: str, path: Path) -> ModuleType:
    """Import the built extension module ``name`` from ``path`` (torch is imported: its libraries are loaded)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the CPU kernels from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` held by this process (POSIX ``flock``; released when the process dies)."""
    with open(path, "a+") as handle:
        if fcntl is None:
            yield
            return
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{WAITING} ({path.parent})", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def compile_sources(name: str, source: str, folder: Path) -> tuple[ModuleType, Path]:
    """Compile ``source`` as module ``name`` in ``folder``: the module and the path of its binary."""
    from torch.utils.cpp_extension import load_inline

    _with_ninja()
    module = load_inline(name, cpp_sources=[source], extra_cflags=list(cflags()), extra_ldflags=list(LDFLAGS),
                         build_directory=str(folder), verbose=False)
    return module, folder / f"{name}.so"


def binary_path(source: str | None = None) -> Path:
    """Where the binary of ``source`` (default: :data:`SOURCES`) is, or will be once built."""
    name = build_name(source_text() if source is None else source)
    return cache_dir() / "cpu_kernels" / name / f"{name}.so"


def compile_extension(compile_fn: Callable[[str, str, Path], tuple[ModuleType, Path]] = compile_sources,
                      paths: tuple[Path, ...] | None = None) -> ModuleType:
    """The kernels of ``paths`` (default: :data:`SOURCES`, the cache's ops): the cached binary when there is one, else
    a build (locked, announced, published atomically)."""
    source = source_text(paths)
    name = build_name(source)
    binary = binary_path(source)
    folder = binary.parent
    if binary.exists():
        return load_binary(name, binary)
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / "build.lock"):
        if binary.exists():  # another process built it while this one waited
            return load_binary(name, binary)
        print(f"{BUILDING} in {folder}", file=sys.stderr, flush=True)
        scratch = folder / f"build-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        try:
            module, built = compile_fn(name, source, scratch)
            (folder / "key.json").write_text(json.dumps(build_key(source), indent=1, sort_keys=True) + "\n")
            os.replace(built, binary)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return module


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
    def loaded(self) -> ModuleType | None:
        """The module once built and loaded (None before the first use or after a failed build); never builds."""
        return self._module

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
