"""`meshlm launch`: start one `meshlm serve --rank r` per hostfile entry, over ssh where needed.

The hostfile is mlx.launch's: `[{"ssh": "mac1.local", "ips": ["10.0.0.1"]}, ...]`,
one entry per rank, rank 0 first (it serves HTTP and leads). It must exist at
the same path on every host, as must the model directory and a meshlm
checkout with its .venv (docs/DISTRIBUTED.md). An `ssh` value of `localhost`
runs the rank here; `netns:NAME` runs it here inside network namespace NAME
(tests use this to give each rank its own network stack).

The cluster secret: local and netns ranks inherit MESHLM_CLUSTER_SECRET from
this process; ssh does not forward it, so remote ranks read the hostfile's
"secret" (`{"secret": ..., "hosts": [...]}`) or their own environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

from meshlm.transport.auth import SECRET_ENV
from meshlm.cluster.bootstrap import ClusterError, Host, Hostfile, cluster_secret, load_hostfile
from meshlm.config import API_KEY_ENV
from meshlm.platform import meshlm_command

log = logging.getLogger(__name__)

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def is_here(host: Host) -> bool:
    """Started on this machine (so it inherits this environment, the secret included), not over ssh."""
    return host.ssh in LOCAL_NAMES or host.ssh.startswith("netns:")


def rank_command(host: Host, cmd: list[str], cwd: str) -> list[str]:
    if host.ssh.startswith("netns:"):
        return ["ip", "netns", "exec", host.ssh[len("netns:"):], *cmd]
    if host.ssh in LOCAL_NAMES:
        return cmd
    remote = f"cd {shlex.quote(cwd)} && exec {shlex.join(cmd)}"
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", host.ssh, remote]


def rank_argv(serve_argv: list[str], hostfile: Path, backend: str, n: int, rank: int) -> list[str]:
    if not serve_argv or serve_argv[0] != "serve":
        raise ClusterError("usage: meshlm launch --hostfile H [--backend B] -- serve [serve options]")
    for flag in ("--rank", "--hostfile", "--tensor-parallel", "--backend"):
        if flag in serve_argv or any(a.startswith(flag + "=") for a in serve_argv):  # "--rank=1" as well
            raise ClusterError(f"{flag} is set by meshlm launch; remove it from the serve options")
    stages = _count(serve_argv, "--pipeline-parallel")
    if stages is not None:  # one stage per hostfile entry; the ranks talk over stage links, not a backend,
        # but --backend mpi is still how a rank started by mpirun knows to read its rank from MPI (cli._rank)
        if stages != n:
            raise ClusterError(f"--pipeline-parallel {stages} but the hostfile lists {n} hosts (one per stage)")
        return [*serve_argv, "--hostfile", str(hostfile), "--backend", backend, "--rank", str(rank)]
    ranks = _count(serve_argv, "--context-parallel")
    if ranks is not None:  # one context-parallel rank per hostfile entry, in an MLX group like TP
        if ranks != n:
            raise ClusterError(f"--context-parallel {ranks} but the hostfile lists {n} hosts (one per rank)")
        return [*serve_argv, "--hostfile", str(hostfile), "--backend", backend, "--rank", str(rank)]
    return [*serve_argv, "--hostfile", str(hostfile), "--backend", backend, "--tensor-parallel", str(n),
            "--rank", str(rank)]


def _count(argv: list[str], flag: str) -> int | None:
    """`flag`'s value as serve will read it (an integer: "02" is 2), or None when it is not given."""
    text = _flag_value(argv, flag)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ClusterError(f"{flag} takes an integer, got {text!r}") from None


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def launch(hostfile: str, backend: str, serve_argv: list[str], dry_run: bool = False) -> int:
    path = Path(hostfile).resolve()
    loaded = load_hostfile(path)
    hosts = list(loaded.hosts)
    check_secret(loaded)
    check_api_key(hosts[0], serve_argv)
    cwd = os.getcwd()
    base = meshlm_command()
    if backend == "mpi":  # mpirun starts every rank; each reads its rank from the MPI environment
        argv = rank_argv(serve_argv, path, backend, len(hosts), 0)[:-2]  # every form ends in "--rank 0"
        cmds = [["mpirun", "-np", str(len(hosts)), "--host", ",".join(h.ssh for h in hosts), *base, *argv]]
    else:  # the leader's stdin is launch's line to it (ssh forwards it too): see _supervise
        cmds = [rank_command(h, base + rank_argv(serve_argv, path, backend, len(hosts), r)
                             + (["--launch-fd", "0"] if r == 0 else []), cwd)
                for r, h in enumerate(hosts)]
    if dry_run:
        for cmd in cmds:
            print(shlex.join(cmd))
        return 0
    _check_tools(cmds)
    # A stop asked for while the ranks start is held until they all have, then passed on as any other:
    # Ctrl-C amid the Popens ended launch at once and left the ranks already started retrying the roll
    # call, where a launch run again within the start timeout took one in as its own rank.
    early: list[int] = []
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda got, _frame: early.append(got))
    if backend == "mpi":  # mpirun starts every rank itself
        return _supervise([subprocess.Popen(cmds[0])], ["mpirun"], early=early)
    # The leader hears of a worker that fails while the cluster starts (one that never connects, say after
    # ssh failed) at once, not at its roll call's deadline: a line on its stdin, over ssh too. Every rank
    # (its ssh, its `ip netns exec`) runs in a session of its own: the terminal's Ctrl-C reaches launch
    # alone, which passes it to the leader, which drains and stops the workers. In launch's group, a
    # worker here ended at the signal itself and the leader got it twice: the stream failed ('worker rank
    # 1 lost', status 70), or the second signal cut the drain's grace.
    procs = [subprocess.Popen(cmd, start_new_session=True) for cmd in reversed(cmds[1:])][::-1]  # workers first
    procs.insert(0, subprocess.Popen(cmds[0], stdin=subprocess.PIPE, start_new_session=True))
    os.set_blocking(procs[0].stdin.fileno(), False)
    return _supervise(procs, [h.ssh for h in hosts], report=procs[0].stdin.fileno(), early=early)


def check_secret(hostfile: Hostfile) -> None:
    """Fail now when no rank here can get a secret; warn when remote ranks may lack one (each rank checks)."""
    remote = [h.ssh for h in hostfile.hosts if not is_here(h)]
    if not remote or SECRET_ENV in os.environ or hostfile.secret is not None:
        cluster_secret(os.environ, hostfile)  # the check every rank makes, before anything starts
    else:
        log.warning("no cluster secret here (%s or the hostfile's \"secret\"): %s must each set %s themselves",
                    SECRET_ENV, ", ".join(remote), SECRET_ENV)
    if remote and hostfile.secret is None and SECRET_ENV in os.environ:
        log.warning("%s is not forwarded over ssh: %s need it in their own environment, or put it in the "
                    "hostfile's \"secret\"", SECRET_ENV, ", ".join(remote))


def check_api_key(leader: Host, serve_argv: list[str]) -> None:
    """Refuse to start a leader that would serve with no API key where this shell has one: ssh does not
    forward MESHLM_API_KEY, and an open server is no safe way to fail (a rank lacking the secret fails)."""
    if is_here(leader) or API_KEY_ENV not in os.environ or _flag_value(serve_argv, "--api-key") is not None:
        return
    raise ClusterError(f"{API_KEY_ENV} is set here, but ssh does not forward it to {leader.ssh}, where rank 0 "
                       "serves HTTP: it would serve with no API key. Pass --api-key (shown in that host's process "
                       f"list), or unset {API_KEY_ENV} here if {leader.ssh}'s own environment sets it")


def _check_tools(cmds: list[list[str]]) -> None:
    for tool in {cmd[0] for cmd in cmds}:
        if shutil.which(tool) is None:
            raise ClusterError(f"{tool} not found: it is needed to start a rank")


POLL_S = 0.2
# What stops a cluster through launch: Ctrl-C, kill, and the terminal hanging up (every rank runs in a
# session of its own, so none of them gets the hang-up: the cluster ran on after the terminal closed).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _supervise(procs: list[subprocess.Popen], names: list[str], report: int | None = None,
               early: list[int] | tuple[int, ...] = ()) -> int:
    """Pass a stop (STOP_SIGNALS) to the leader, which drains and stops the workers: SIGINT and SIGTERM as
    they came, a hang-up as SIGTERM, and one that came while the ranks started (`early`) as SIGTERM once
    they all have (the leader is then still importing Python, where a SIGINT was a 'Fatal Python error').
    Say at once when a worker fails while the leader runs, here and to the leader on `report` (the leader
    says what it means: a start that ends, or an unhealthy cluster; a worker the leader stopped exits 0,
    unreported); wait for every rank."""
    leader = procs[0]
    forwarded: list[int] = []

    def forward(sig=signal.SIGTERM, _frame=None):
        if leader.poll() is None:
            sent = signal.SIGTERM if sig == signal.SIGHUP else sig
            forwarded.append(sent)
            leader.send_signal(sent)

    for sig in STOP_SIGNALS:
        signal.signal(sig, forward)
    if early:
        forward()
    told: set[int] = set()
    while (code := leader.poll()) is None:
        for rank, proc in enumerate(procs[1:], start=1):
            status = proc.poll()
            if status and rank not in told:
                told.add(rank)
                news = f"rank {rank} ({names[rank]}) exited with status {status} while the leader runs"
                log.warning("%s", news)
                if report is not None:
                    with contextlib.suppress(OSError):  # a leader that no longer listens (or a full pipe)
                        os.write(report, news.encode() + b"\n")
        time.sleep(POLL_S)
    deadline = time.monotonic() + 10
    for proc in procs[1:]:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("rank still running 10 s after the leader exited; killing it")
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)  # reaped, not left for launch's own exit
    # uvicorn re-raises the signal after its orderly shutdown, and a start interrupted before serving
    # exits 128 + the signal: either is a clean stop we asked for.
    if forwarded and code in (-forwarded[0], 128 + forwarded[0]):
        return 0
    # A leader killed by a signal: its status as a shell reports one (SIGKILL 137, not 256 - 9 = 247)
    return 128 - code if code < 0 else code
