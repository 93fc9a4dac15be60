"""Compile a C++ source into a cached shared object on first use and load it with ctypes.

The kernels of hetquant are C++ files shipped as package data beside their Python wrappers
(``runtime/kernels/int4_gemv.cpp``, ``formats/_quant_native.cpp``). :class:`NativeLibrary` builds one
with the system C++ compiler (``$CXX``, else ``g++``, ``c++`` or ``clang++``) into
``$HETQUANT_CACHE_DIR`` (default ``~/.cache/hetquant``; a directory under the system temp dir
when that one is not writable):

* the file name carries a key, the sha256 of source, compiler, flags and machine, so a changed
  source or compiler gets its own build and an unchanged one is compiled once per machine;
* the object is written under a temporary name and renamed (``os.replace``), so concurrent first
  uses in several processes are safe; within a process a lock makes the build happen once;
* every failure (no compiler, compile error, load error, or the library disabled through its
  environment variable) leaves ``lib = None`` with the reason in ``error``; :meth:`get` logs it
  once as a warning and callers fall back to their torch reference path.

No ``-march`` flag: the objects stay portable (per-function ``target`` attributes choose an
instruction set at run time where a kernel wants one), and no ``-ffast-math``: results must be
IEEE-exact, bit-identical to the torch reference code.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_FLAGS",
    "NativeBuild",
    "NativeLibrary",
    "cache_dir",
    "find_compiler",
    "load_defined",
]

DEFAULT_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
_COMPILE_TIMEOUT_S = 300

log = logging.getLogger("hetquant.native")


@dataclass
class NativeBuild:
    """One build attempt: the loaded library, or why there is none."""

    lib: ctypes.CDLL | None = None
    path: str | None = None  # the shared object
    compile_s: float | None = None  # None: loaded from the cache, or not built
    error: str | None = None


def cache_dir() -> Path:
    """``$HETQUANT_CACHE_DIR``, default ``~/.cache/hetquant``."""
    env = os.environ.get("HETQUANT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "hetquant"


def find_compiler() -> str | None:
    """The first of ``$CXX``, ``g++``, ``c++``, ``clang++`` found on PATH."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


class NativeLibrary:
    """A C++ source compiled on first use (see the module docstring).

    Args:
        name: file-name stem of the cached source and shared object.
        source: the C++ translation unit.
        bind: sets ``argtypes``/``restype`` of the loaded library's functions; an
            ``AttributeError`` or ``OSError`` from it counts as a load failure.
        flags: compiler flags (part of the cache key).
        libs: trailing link arguments, e.g. ``("-lpthread",)`` (part of the cache key).
        disable_env: an environment variable that disables the library when set to ``torch``.
        compiler: a fixed compiler command instead of :func:`find_compiler`.
        label: how the warning names the library.
        fallback: what the warning says runs instead (default: torch).
        logger: where the warning goes (default ``hetquant.native``).
    """

    def __init__(
        self,
        name: str,
        source: str,
        bind: Callable[[ctypes.CDLL], None],
        *,
        flags: Sequence[str] = DEFAULT_FLAGS,
        libs: Sequence[str] = (),
        disable_env: str | None = None,
        compiler: str | None = None,
        label: str | None = None,
        logger: logging.Logger | None = None,
        fallback: str = "torch",
    ) -> None:
        self.name, self.source, self.bind = name, source, bind
        self.flags, self.libs = tuple(flags), tuple(libs)
        self.disable_env, self.compiler = disable_env, compiler
        self.label, self.log = label or name, logger or log
        self.fallback = fallback
        self._built: NativeBuild | None = None
        self._lock = threading.Lock()
        _DEFINED.add(self)

    def get(self) -> NativeBuild:
        """The build of this process, made on first call (thread-safe); warns once on failure."""
        built = self._built
        if built is None:
            with self._lock:
                if self._built is None:
                    nat = self.build()
                    if nat.lib is None:
                        msg = "%s: native kernel unavailable (%s); using %s"
                        self.log.warning(msg, self.label, nat.error, self.fallback)
                    self._built = nat
                built = self._built
        return built

    def reset(self) -> None:
        """Forget the build so that the next :meth:`get` redoes it (tests, env changes)."""
        with self._lock:
            self._built = None

    def build(self) -> NativeBuild:
        """Compile (unless cached) and load, without touching the per-process memo."""
        nat = NativeBuild()
        if self.disable_env and os.environ.get(self.disable_env, "").lower() == "torch":
            nat.error = f"disabled by {self.disable_env}=torch"
            return nat
        cxx = self._compiler()
        if cxx is None:
            nat.error = (
                f"C++ compiler {self.compiler!r} not found"
                if self.compiler
                else "no C++ compiler (g++, c++ or clang++) on PATH"
            )
            return nat
        so = self._compile(cxx, nat)
        if so is None:
            return nat
        try:
            lib = ctypes.CDLL(str(so))
            self.bind(lib)
        except (OSError, AttributeError) as e:
            nat.error = f"cannot load {so}: {e}"
            return nat
        nat.lib, nat.path, nat.error = lib, str(so), None
        return nat

    def _compiler(self) -> str | None:
        if self.compiler is not None:
            return self.compiler if shutil.which(self.compiler) else None
        return find_compiler()

    def _compile(self, cxx: str, nat: NativeBuild) -> Path | None:
        """Path of the cached object, compiled now if missing; None (and ``nat.error``) on
        failure. Tries the cache dir, then one under the temp dir."""
        key = "\0".join([self.source, cxx, *self.flags, *self.libs, os.uname().machine])
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        stem = f"{self.name}-{digest}"
        for d in (cache_dir(), Path(tempfile.gettempdir()) / "hetquant-cache"):
            try:
                d.mkdir(parents=True, exist_ok=True)
                so = d / f"{stem}.so"
                if so.exists():
                    return so
                t0 = time.perf_counter()
                src = d / f"{stem}.cpp"
                tmp = d / f".{stem}-{os.getpid()}-{threading.get_ident()}"
                tmp.with_suffix(".cpp").write_text(self.source, encoding="utf-8")
                os.replace(tmp.with_suffix(".cpp"), src)
                res = subprocess.run(
                    [cxx, *self.flags, "-o", str(tmp.with_suffix(".so")), str(src), *self.libs],
                    capture_output=True,
                    text=True,
                    timeout=_COMPILE_TIMEOUT_S,
                )
                if res.returncode != 0:
                    tmp.with_suffix(".so").unlink(missing_ok=True)
                    nat.error = f"{cxx} failed: {res.stderr.strip()[-2000:]}"
                    return None
                os.replace(tmp.with_suffix(".so"), so)
                nat.compile_s = time.perf_counter() - t0
                return so
            except (OSError, subprocess.SubprocessError) as e:
                nat.error = f"cannot build in {d}: {e}"
        return None


_DEFINED: weakref.WeakSet[NativeLibrary] = weakref.WeakSet()  # the libraries alive here


def load_defined() -> None:
    """Build or load every library defined so far (:meth:`NativeLibrary.get`): before forking
    workers, which then inherit the loaded libraries instead of each compiling on a cold cache."""
    for lib in list(_DEFINED):
        lib.get()
