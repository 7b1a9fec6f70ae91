"""A disk cache of transformers' index of its own lazy modules, so a process starts ~0.5 s sooner.

Every process that loads a tokenizer imports transformers (mlx-lm's tokenizer_utils does), and
transformers builds the index of its lazy modules by reading each of its ~1,100 model folders' ~3,400
files for their `__all__` and backends (`create_import_structure_from_path`), twice over (its
`__init__` and `models/__init__` key the same folder differently): its import took 0.96-1.10 s on one
core, 0.50 s with this cache (2026-12-07). A server and each of a cluster's ranks pay that on every
start, and the test suite starts ~280 of them. The index depends only on the installed files, so it is
kept as JSON under the cache root, one file per folder transformers scans (three), keyed by transformers' version and the folder's path and mtime:
an upgrade or a reinstall makes new keys.

`install` must run before transformers is first imported; it hooks the one module that defines the
scan, and wraps only the outermost call of it (the scan recurses into subfolders itself). Anything
unexpected (another transformers layout, an unreadable or damaged cache file, a read-only disk) falls
back to transformers' own scan: this only ever changes how fast the index is made.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

MODULE = "transformers.utils.import_utils"
SCAN = "create_import_structure_from_path"
FORMAT = 1  # bumped when the encoding below changes


def install(cache_dir: Path) -> bool:
    """Hook transformers' index scan to `cache_dir`; False (and nothing done) if transformers is already
    imported or not installed."""
    if "transformers" in sys.modules or importlib.machinery.PathFinder.find_spec("transformers") is None:
        return False
    sys.meta_path.insert(0, _HookFinder(cache_dir))
    return True


class _HookFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the loader of MODULE so that the scan is replaced right after the
    module runs, before transformers' `__init__` calls it; then it leaves sys.meta_path."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not isinstance(spec.loader, importlib.abc.Loader):
            return spec
        spec.loader = _PatchingLoader(spec.loader, self.cache_dir)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, cache_dir: Path) -> None:
        self.loader = loader
        self.cache_dir = cache_dir

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        scan = getattr(module, SCAN, None)
        if callable(scan):
            version = _transformers_version()
            if version is not None:
                setattr(module, SCAN, cached_scan(scan, self.cache_dir, version))

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self.loader, name)


def _transformers_version() -> str | None:
    """The package's `__version__`, set on its first line, before it imports MODULE."""
    version = getattr(sys.modules.get("transformers"), "__version__", None)
    return version if isinstance(version, str) else None


def cached_scan(scan: Callable[[str], dict], cache_dir: Path, version: str) -> Callable[[str], dict]:
    """`scan` answered from `cache_dir` for its outermost calls; the recursive ones (the scan calls itself
    through its module's global) go straight to `scan`."""
    depth = [0]

    @functools.wraps(scan)
    def wrapper(module_path):
        if depth[0]:
            return scan(module_path)
        depth[0] += 1
        try:
            return _scan_through_cache(scan, module_path, cache_dir, version)
        finally:
            depth[0] -= 1

    return wrapper


def _scan_through_cache(scan, module_path, cache_dir: Path, version: str) -> dict:
    folder = os.path.dirname(module_path) if os.path.isfile(module_path) else module_path
    try:
        stamp = os.stat(folder).st_mtime_ns
    except OSError:
        return scan(module_path)
    key = hashlib.sha256(f"{FORMAT}\0{version}\0{os.path.abspath(folder)}\0{stamp}".encode()).hexdigest()[:24]
    path = cache_dir / f"{key}.json"
    try:
        return decode(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        pass  # not cached yet, or damaged: scanned and written again
    structure = scan(module_path)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(encode(structure)))
        os.replace(tmp, path)  # whole or absent for a process reading it at once
    except (OSError, TypeError, ValueError) as exc:
        log.debug("transformers' module index not cached in %s: %s", cache_dir, exc)
    return structure


# The index is dicts keyed by folder names (str) or by backends (frozenset of str), down to sets of names.
# JSON has neither sets nor non-string keys: a dict is ["d", [[key, value], ...]] with a frozenset key as
# ["f", [names]], a set is ["s", [names]], a string is itself.

def encode(x: Any) -> Any:
    if isinstance(x, str):
        return x
    if isinstance(x, dict):
        return ["d", [[_encode_key(k), encode(v)] for k, v in x.items()]]
    if isinstance(x, (set, frozenset)) and all(isinstance(v, str) for v in x):
        return ["s", sorted(x)]
    raise TypeError(f"unexpected {type(x).__name__} in transformers' module index")


def _encode_key(k: Any) -> Any:
    if isinstance(k, str):
        return k
    if isinstance(k, frozenset) and all(isinstance(v, str) for v in k):
        return ["f", sorted(k)]
    raise TypeError(f"unexpected key {type(k).__name__} in transformers' module index")


def decode(x: Any) -> Any:
    if isinstance(x, str):
        return x
    tag, body = x
    if tag == "d":
        return {_decode_key(k): decode(v) for k, v in body}
    if tag == "s":
        return {_name(v) for v in body}
    raise ValueError(f"unknown tag {tag!r}")


def _decode_key(k: Any) -> Any:
    if isinstance(k, str):
        return k
    tag, body = k
    if tag != "f":
        raise ValueError(f"unknown key tag {tag!r}")
    return frozenset(_name(v) for v in body)


def _name(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"a name that is a {type(v).__name__}")
    return v
