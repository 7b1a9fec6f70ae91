"""mlx_lm.utils sets the open-file limit to (2048, 4096) when imported; meshlm's import of it must not."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

IMPORT_AND_REPORT = """
import json, resource
from meshlm.platform import import_mlx_lm
import_mlx_lm()
import_mlx_lm("mlx_lm.tool_parsers.json_tools")
print(json.dumps(resource.getrlimit(resource.RLIMIT_NOFILE)))
"""


def limits_after_import(soft: int, hard: int) -> tuple[int, int]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    r = subprocess.run([sys.executable, "-c", IMPORT_AND_REPORT], capture_output=True, text=True, timeout=120,
                       preexec_fn=limit)
    assert r.returncode == 0, r.stderr[-2000:]
    return tuple(json.loads(r.stdout))


HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]


@pytest.mark.parametrize("soft, hard, want", [
    # below mlx-lm's 4096: its own call fails unprivileged ("not allowed to raise maximum limit")
    (1000, 1000, (1000, 1000)),
    # above: its call would lower both, the hard limit for good
    (min(HARD, 20000), min(HARD, 20000), (min(HARD, 20000), min(HARD, 20000))),
    # a low soft limit (macOS shells: 256) is raised as mlx-lm meant to, within the hard limit
    (256, min(HARD, 20000), (2048, min(HARD, 20000))),
    (256, 1500, (1500, 1500)),
])
def test_importing_mlx_lm_keeps_the_open_file_limit(soft, hard, want):
    assert limits_after_import(soft, hard) == want
