"""Large all-reduces go in pieces (transport/collectives.py) and sum exactly what one piece would."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest

from meshlm.cluster import bootstrap
from meshlm.transport.collectives import all_sum

RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    import mlx.core as mx
    from meshlm.transport.collectives import all_sum
    group = mx.distributed.init(backend="ring")
    x = mx.random.normal((1, 300, 96), key=mx.random.key(group.rank()))
    whole = mx.distributed.all_sum(x, group=group)
    pieces = all_sum(x, group, chunk_bytes=96 * 4 * 64)  # 64 rows per piece: 5 pieces
    expected = mx.random.normal((1, 300, 96), key=mx.random.key(0)) + mx.random.normal((1, 300, 96), key=mx.random.key(1))
    print(json.dumps({"shape": pieces.shape, "vs_whole": mx.abs(pieces - whole).max().item(),
                      "vs_expected": mx.abs(pieces - expected).max().item()}))
""")


def test_one_rank_pieces_are_the_input_itself():
    x = mx.random.normal((2, 700, 64))
    out = all_sum(x, mx.distributed.init(), chunk_bytes=64 * 4 * 100)
    assert out.shape == x.shape and mx.array_equal(out, x).item()


def _port_run(n: int) -> int:
    while True:
        base = bootstrap.free_port()
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base + 1, base + n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base


@pytest.mark.timeout(60)
def test_two_ranks_sum_in_pieces_exactly(tmp_path):
    base = _port_run(2)
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(r)})
             for r in (1, 0)]
    outs = [p.communicate(timeout=50) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-800:] for _, err in outs]
    for out, _ in outs:
        got = json.loads(out.strip().splitlines()[-1])
        assert got["shape"] == [1, 300, 96]
        assert got["vs_whole"] == 0.0  # the same additions, element by element
        assert got["vs_expected"] < 1e-5
