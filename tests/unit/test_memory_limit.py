"""The memory a process may use: the machine's RAM, or its cgroup's limit (a container, a systemd unit)
when that is lower; the KV budget's default and its check follow it."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshlm import platform
from meshlm.config import SchedulerConfig

GiB = 2**30


def tree(root: Path, own: str, files: dict[str, str]) -> tuple[Path, Path]:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "self-cgroup").write_text(own)
    return root / "fs", root / "self-cgroup"


@pytest.mark.parametrize("own,files,limit", [
    # v2, a systemd unit's MemoryMax: the process's own cgroup
    ("0::/system.slice/meshlm.service\n", {"fs/system.slice/meshlm.service/memory.max": "4294967296\n",
                                           "fs/memory.max": "max\n"}, 4 * GiB),
    # v2: the lowest limit on the way up counts (a slice's)
    ("0::/user.slice/a/b\n", {"fs/user.slice/memory.max": str(2 * GiB), "fs/user.slice/a/b/memory.max": "max"},
     2 * GiB),
    # a container: its cgroup is the mount's root, the path in /proc/self/cgroup does not exist inside it
    ("0::/docker/0123abcd\n", {"fs/memory.max": str(6 * GiB)}, 6 * GiB),
    # v1 (this build machine's layout), unlimited
    ("4:memory:/process_api/acfe\n1:cpu:/\n0::/\n",
     {"fs/memory/process_api/acfe/memory.limit_in_bytes": "9223372036854771712"}, None),
    # v1 with a limit
    ("9:cpu,cpuacct:/x\n4:memory:/docker/1234\n", {"fs/memory/memory.limit_in_bytes": str(3 * GiB)}, 3 * GiB),
    # hybrid: v2 under unified/
    ("0::/svc\n", {"fs/unified/svc/memory.max": str(5 * GiB)}, 5 * GiB),
    # nothing readable, or nonsense
    ("0::/\n", {}, None),
    ("garbage\n", {"fs/memory.max": str(GiB)}, None),
    ("0::/\n", {"fs/memory.max": "lots"}, None),
])
def test_the_cgroup_limit_is_the_lowest_on_the_way_up(tmp_path, own, files, limit):
    root, self_cgroup = tree(tmp_path, own, files)
    assert platform.cgroup_memory_limit(root, self_cgroup) == limit


def test_no_cgroup_file_is_no_limit(tmp_path):
    assert platform.cgroup_memory_limit(tmp_path, tmp_path / "missing") is None


def test_a_container_limit_below_the_ram_bounds_the_kv_default_and_its_check(monkeypatch):
    monkeypatch.setattr(platform, "cgroup_memory_limit", lambda *a: 2 * GiB)
    assert platform.physical_memory() == 2 * GiB
    assert platform.kv_budget_bytes(SchedulerConfig()) == GiB // 2  # a quarter of what the container may use
    with pytest.raises(ValueError, match=r"more than this machine's RAM \(2.0 GiB, its cgroup limit\)"):
        platform.kv_budget_bytes(SchedulerConfig(kv_cache_memory=3 * GiB))
