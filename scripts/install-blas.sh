#!/usr/bin/env bash
# MLX's Linux CPU wheel links a slow reference BLAS; Debian's OpenBLAS makes
# fp32 GEMM 17x faster here when preloaded (meshlm does that itself when present).
# Best effort: without root or apt, meshlm still runs, only slower.
set -u
[ "$(uname -s)" = Linux ] || exit 0
ls /usr/lib/*/openblas-pthread/libopenblas*.so* >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get install -y -qq libopenblas0-pthread || { apt-get update -qq && apt-get install -y -qq libopenblas0-pthread; }) >/dev/null 2>&1 \
    && echo "installed libopenblas0-pthread" || echo "could not install libopenblas0-pthread; serving stays on MLX's reference BLAS"
else
  echo "OpenBLAS not found; 'apt-get install libopenblas0-pthread' makes the CPU path much faster"
fi
