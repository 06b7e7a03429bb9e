"""Build, cache and register the native XLA:CPU handlers in `native/*.cc` (jax.ffi).

A handler's source is compiled on first use with the system C++ compiler (`$CXX`, else `c++`)
against the FFI headers of the installed jaxlib, and cached by the hash of source, flags and
jaxlib version under `$CP_RUNTIME_CACHE` (default `~/.cache/cp-runtime`); later processes load
the cached library. Compiling takes a few seconds.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import warnings

import jax
import jaxlib

__all__ = ["NativeBuildError", "CXX_FLAGS", "library_path", "register", "status"]

CXX_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w")


class NativeBuildError(RuntimeError):
    """A native handler could not be compiled or loaded (the message says why)."""


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("CP_RUNTIME_CACHE")
    return pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "cp-runtime"


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise NativeBuildError(f"no C++ compiler: {cxx!r} is not on PATH (set $CXX)")
    return cxx


def library_path(source: pathlib.Path) -> pathlib.Path:
    """Where the library of `source`, built with these flags against this jaxlib, is (or will
    be) cached."""
    digest = hashlib.sha256(source.read_bytes())
    digest.update(" ".join(CXX_FLAGS).encode())
    digest.update(jaxlib.__version__.encode())
    return _cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def _build(source: pathlib.Path, target: pathlib.Path) -> None:
    """Compile into a temporary file beside `target`, then rename: processes that build at
    once (Ray workers) each write their own file, and the rename is atomic."""
    cxx = _compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cxx, *CXX_FLAGS, "-I", jax.ffi.include_dir(), str(source), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise NativeBuildError(f"compiling {source.name} failed ({' '.join(cmd)}):\n"
                                   f"{done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def register(source: pathlib.Path, symbol: str, target: str) -> None:
    """Build `source` (unless cached), load it and register its handler `symbol` with XLA for
    CPU as FFI target `target`. Raises NativeBuildError."""
    path = library_path(source)
    if not path.exists():
        _build(source, path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        raise NativeBuildError(f"loading {path} failed: {err}") from err
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


def status(source: pathlib.Path, symbol: str, target: str, unavailable: str) -> str:
    """`register`, reporting instead of raising: 'native' when the handler is registered, else
    'unavailable: <why>', with a warning `unavailable: <why>` (the caller's fallback)."""
    try:
        register(source, symbol, target)
    except NativeBuildError as err:
        warnings.warn(f"{unavailable}: {err}", RuntimeWarning, stacklevel=3)
        return f"unavailable: {err}"
    return "native"
