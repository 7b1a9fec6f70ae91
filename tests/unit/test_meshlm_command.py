"""How meshlm starts meshlm (platform.meshlm_command: never importing the working directory's files; interrupt_deferred)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshlm import platform


@pytest.mark.parametrize("form", ["this-python", "python-3.10"])
def test_meshlm_runs_without_the_working_directorys_files(tmp_path, form):
    (tmp_path / "argparse.py").write_text("raise SystemExit(3)\n")  # the CLI imports it first
    (tmp_path / "runpy.py").write_text("raise SystemExit(4)\n")
    cmd = platform.meshlm_command() if form == "this-python" else [sys.executable, "-c", platform._WITHOUT_CWD]
    r = subprocess.run([*cmd, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage: meshlm" in r.stdout, (r.returncode, r.stderr[-1000:])
    # Plain `python -m meshlm` imports them: the files above do bite.
    assert subprocess.run([sys.executable, "-m", "meshlm", "--help"], cwd=tmp_path,
                          capture_output=True, timeout=60).returncode == 3


def test_ctrl_c_inside_interrupt_deferred_is_raised_once_it_ends():
    import os
    import signal
    import threading

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with platform.interrupt_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # bytecodes run: a pending KeyboardInterrupt would be raised here
                pass
            reached.append(True)
    assert reached == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def off_main() -> None:  # no signals there: nothing to defer, and signal.signal would refuse
        with platform.interrupt_deferred():
            reached.append("thread")

    t = threading.Thread(target=off_main)
    t.start()
    t.join()
    assert reached[-1] == "thread"
