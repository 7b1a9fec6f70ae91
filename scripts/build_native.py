"""Compile meshlm's native MLX primitives against the installed MLX: csrc/cpu_ops.cpp into
meshlm/model/_cpu_ops*.so (the CPU kernels) and csrc/local_reduce.cpp into
meshlm/transport/_local_reduce*.so (the shared-memory all-reduce of local ranks).

Optional: without a C++20 compiler or nanobind, meshlm runs its pure-MLX
kernels and MLX's own all-reduce instead (it logs which). `make install` runs this on Linux; it is
built for the machine it runs on (-march=native) and for this exact MLX
version (the module records it, and meshlm ignores a build for another one).
nanobind must be the release MLX's own bindings were built with, under MLX's
nanobind domain, so that mx.array crosses between the two modules.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")
# (what it is, its source, the module built from it)
EXTENSIONS = (
    ("cpu_ops", ROOT / "csrc" / "cpu_ops.cpp", ROOT / "meshlm" / "model" / f"_cpu_ops{SUFFIX}"),
    ("local_reduce", ROOT / "csrc" / "local_reduce.cpp", ROOT / "meshlm" / "transport" / f"_local_reduce{SUFFIX}"),
)


def command(source: Path, out: Path) -> list[str]:
    import mlx.core as mx
    import nanobind

    mlx_dir = Path(mx.__file__).parent  # mlx/core is a directory in some wheels, a .so in others
    mlx_dir = mlx_dir if (mlx_dir / "include").is_dir() else mlx_dir.parent
    nb_src = Path(nanobind.source_dir())
    return [
        shutil.which("g++") or shutil.which("c++") or "c++",
        "-O3", "-march=native", "-fopenmp-simd", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden",
        "-DNB_DOMAIN=mlx", f'-DMESHLM_MLX_VERSION="{mx.__version__}"',
        f"-I{mlx_dir / 'include'}", f"-I{nanobind.include_dir()}",
        f"-I{nb_src.parent / 'ext' / 'robin_map' / 'include'}", f"-I{sysconfig.get_paths()['include']}",
        str(nb_src / "nb_combined.cpp"), str(source),
        f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}",
        "-o", str(out),
    ]


def build(what: str, source: Path, target: Path) -> Callable[[], int] | int:
    """Start compiling `source`; returns a call that waits for it and installs the module (its status),
    or a status at once when it cannot start."""
    # Built beside the target, then renamed over it: a running server keeps the file it mapped.
    partial = target.with_name(target.name + ".partial")
    try:
        cmd = command(source, partial)
    except ImportError as e:
        print(f"{what}: not built ({e}); meshlm will use MLX's own ops")
        return 1
    print(f"{what}: building", target.relative_to(ROOT), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def finish() -> int:
        _, err = proc.communicate()
        if proc.returncode != 0:
            partial.unlink(missing_ok=True)
            target.unlink(missing_ok=True)
            print(f"{what}: build failed; meshlm will use MLX's own ops\n$ {shlex.join(cmd)}\n{err[-4000:]}")
            return 1
        os.replace(partial, target)
        return 0

    return finish


def main() -> int:
    if sys.platform != "linux":
        print("native ops: not built (only Linux runs MLX on the CPU; macOS uses Metal)")
        return 0
    started = [build(*ext) for ext in EXTENSIONS]  # side by side: one compiler per core
    return max(s if isinstance(s, int) else s() for s in started)


if __name__ == "__main__":
    sys.exit(main())
