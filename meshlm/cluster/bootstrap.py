"""Starting a tensor-parallel cluster: checks, hostfiles, rank processes, the MLX group.

Everything that can be wrong is checked before any weights load: the model
must have `shard()`, the rank count must divide its attention and KV heads,
the backend must exist and have its settings.
"""

from __future__ import annotations

import errno
import faulthandler
import ipaddress
import json
import logging
import math
import os
import random
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshlm.config import ParallelConfig
from meshlm.platform import meshlm_command, pid_alive
from meshlm.transport.auth import SECRET_ENV, ClusterSecret

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """A cluster that cannot start; the message says what to fix."""


def check_shardable(model_path: Path, n: int) -> None:
    """What config.json says about a tensor-parallel split, checked before any rank starts. (Every supported
    model type's mlx-lm class has a `shard`; the loader checks the class itself.)"""
    from meshlm.model.adapt import check_supported
    from meshlm.model.loader import read_config

    config = read_config(model_path)
    check_supported(config)
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads") or config.get(
        "num_attention_heads")
    if not all(isinstance(h, int) and h > 0 for h in (heads, kv_heads)):
        raise ClusterError(f"{model_path / 'config.json'}: num_attention_heads {heads!r} and num_key_value_heads "
                           f"{kv_heads!r} must be positive integers")
    if heads % n or kv_heads % n:
        raise ClusterError(f"--tensor-parallel {n} must divide the attention heads ({heads}) and KV heads "
                           f"({kv_heads}) of {model_path.name}")


def check_backend(cfg: ParallelConfig) -> None:
    import mlx.core as mx

    if not mx.distributed.is_available(cfg.backend):
        raise ClusterError(f"the {cfg.backend} backend is not available in this MLX build")


LISTEN_PORTS = range(20000, 32768)  # below Linux's (and macOS's 49152+) ephemeral source ports


def free_port(host: str = "127.0.0.1", avoid: range | set = range(0)) -> int:
    """A free port to listen on, outside the ephemeral range: while a rank retries connecting to a
    port nothing listens on yet, one of its own ephemeral source ports can *be* that port, and TCP
    then connects it to itself (a simultaneous open), stealing the port from the rank meant to listen."""
    rng = random.Random()
    while True:
        port = rng.choice(LISTEN_PORTS)
        if port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port


@dataclass(frozen=True)
class Host:
    ssh: str
    ips: tuple[str, ...]
    memory_gb: float | None = None  # optional: pipeline stages get layers in proportion to it


@dataclass(frozen=True)
class Hostfile:
    hosts: tuple[Host, ...]
    secret: ClusterSecret | None  # its "secret", if it has one (redacted in any repr)


HOSTFILE_FORMS = '[{"ssh": ..., "ips": [...]}, ...] or {"secret": ..., "hosts": [{"ssh": ..., "ips": [...]}, ...]}'


def load_hostfile(path: str | Path) -> Hostfile:
    """mlx.launch's list, one {"ssh", "ips"} entry per rank, or an object that adds the cluster secret:
    {"secret": "...", "hosts": [...]}."""
    try:
        data = json.loads(Path(path).read_text())
        entries, secret = (data["hosts"], data.get("secret")) if isinstance(data, dict) else (data, None)
        hosts = tuple(_host(h) for h in entries)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:  # Recursion: [[[...
        raise ClusterError(f"cannot read hostfile {path}: {exc} (expected {HOSTFILE_FORMS})") from None
    if not hosts:
        raise ClusterError(f"hostfile {path} lists no hosts")
    return Hostfile(hosts, _hostfile_secret(path, secret))


def _host(entry: object) -> Host:
    if not isinstance(entry, dict):
        raise ValueError(f'each host is an object {{"ssh": ..., "ips": [...]}}, got {entry!r}')
    ssh = _name(entry.get("ssh"), '"ssh"')
    if ssh.startswith("netns:"):  # `ip netns exec NAME`: a NAME starting with '-' is read as an option of `ip`
        _name(ssh[len("netns:"):], 'the namespace of a "netns:" host')
    ips = entry.get("ips")
    if not ips:  # mlx.launch's default: the ssh name is the address too
        return Host(ssh, (ssh,), _memory(entry.get("memory_gb")))
    if not isinstance(ips, list):
        raise ValueError(f'"ips" of {ssh} must be a list of addresses, got {ips!r}')
    return Host(ssh, tuple(_ip(_name(ip, f'an "ips" entry of {ssh}'), ssh) for ip in ips),
                _memory(entry.get("memory_gb")))


def _name(value: object, what: str) -> str:
    """A host name or address as ssh and the sockets take it. One that starts with '-' would be read by ssh
    as an option (`-oProxyCommand=...` runs a command here), and whitespace or control characters are in
    no name."""
    if not isinstance(value, str) or not value or value.startswith("-") or any(c.isspace() or ord(c) < 32
                                                                                  for c in value):
        raise ValueError(f"{what} must be a host name or address (no leading '-', no spaces), got {value!r}")
    return value


def _ip(value: str, ssh: str) -> str:
    """An "ips" entry: an address the rank's sockets bind and connect to, so an IP and no port (ports come
    from --ring-port, --control-port, --stage-port); "10.0.0.1:99999" failed as a traceback at the bind."""
    try:
        ipaddress.ip_address(value)  # IPv6 with a zone too ("fe80::1%eth0")
    except ValueError:
        raise ValueError(f'an "ips" entry of {ssh} must be an IP address (no port), got {value!r}') from None
    return value


def _memory(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f'"memory_gb" must be a positive number, got {value!r}')
    return float(value)


def _hostfile_secret(path: str | Path, text: object) -> ClusterSecret | None:
    if text is None:
        return None
    try:
        secret = ClusterSecret(text, f'the "secret" of hostfile {path}')  # type: ignore[arg-type]
    except ValueError as exc:
        raise ClusterError(str(exc)) from None
    if Path(path).stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("hostfile %s holds the cluster secret but other users can read it: chmod 600 it", path)
    return secret


def read_hostfile(path: str | Path) -> list[Host]:
    return list(load_hostfile(path).hosts)


def cluster_secret(environ: Mapping[str, str], hostfile: Hostfile | None = None) -> ClusterSecret:
    """The secret of a cluster this process did not start itself: MESHLM_CLUSTER_SECRET, else the hostfile's."""
    if SECRET_ENV in environ:
        try:
            return ClusterSecret(environ[SECRET_ENV], SECRET_ENV)
        except ValueError as exc:
            raise ClusterError(str(exc)) from None
    if hostfile is not None and hostfile.secret is not None:
        return hostfile.secret
    raise ClusterError(f"this cluster has no secret: set {SECRET_ENV} to the same value on every rank, or give "
                       'the hostfile one ({"secret": "...", "hosts": [...]}); generate it with '
                       "`openssl rand -hex 32` (docs/DISTRIBUTED.md, Security)")


def ring_hostfile(hosts: list[Host], base_port: int) -> list[list[str]]:
    """The ring backend's own format: per rank, the ip:port it listens on."""
    return [[f"{h.ips[0]}:{base_port + r}"] for r, h in enumerate(hosts)]


@dataclass(frozen=True)
class LocalCluster:
    """N ranks on this machine: a ring hostfile on free loopback ports, a control port, and a stage link
    port per rank (used by pipeline stages), in a private directory that also names rank 0 (its pid), so a
    worker can tell rank 0 died before the cluster formed."""

    hostfile: Path
    control_addr: str
    stage_addrs: tuple[str, ...] = ()

    @classmethod
    def create(cls, n: int) -> "LocalCluster":
        _remove_abandoned()
        tmp = Path(tempfile.mkdtemp(prefix=LOCAL_PREFIX))
        hostfile = tmp / "ring.json"
        used: set[int] = set()

        def port() -> int:
            p = free_port(avoid=used)
            used.add(p)
            return p

        hostfile.write_text(json.dumps([[f"127.0.0.1:{port()}"] for _ in range(n)]))
        (tmp / LEADER_FILE).write_text(str(os.getpid()))
        return cls(hostfile, f"127.0.0.1:{port()}", tuple(f"127.0.0.1:{port()}" for _ in range(n)))


LEADER_FILE = "leader"
LOCAL_PREFIX = "meshlm-tp-"


def _remove_abandoned() -> None:
    """Remove the directories of local clusters whose rank 0 is gone: one killed while its cluster started
    (systemd stops a whole control group with SIGTERM) left its ring file and ports behind for good."""
    for d in Path(tempfile.gettempdir()).glob(LOCAL_PREFIX + "*"):
        try:
            leader = int((d / LEADER_FILE).read_text())
        except (OSError, ValueError):  # not one of ours, or being written: left alone
            continue
        if not pid_alive(leader) and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)


def local_cluster_dir(ring_file: Path) -> Path | None:
    """The private directory of the local cluster whose ring file this is (`LocalCluster.create`), or None."""
    d = ring_file.parent
    return d if d.name.startswith(LOCAL_PREFIX) and (d / LEADER_FILE).is_file() else None


def local_leader_gone(ring_file: Path) -> Callable[[], str | None]:
    """A local worker's watch on rank 0, which started it: why the cluster will never form once rank 0 has
    died (its children are re-parented, even before this looked), removing the directory rank 0 no longer can."""
    try:
        leader = int((ring_file.parent / LEADER_FILE).read_text())
    except (OSError, ValueError):
        raise ClusterError(f"no rank 0 named in {ring_file.parent}: a local worker is started by rank 0") from None

    def gone() -> str | None:
        if os.getppid() == leader:
            return None
        shutil.rmtree(ring_file.parent, ignore_errors=True)
        return "rank 0 ended before the cluster formed"

    return gone


LAUNCH_GONE = "meshlm launch exited (killed?): nothing supervises this cluster any more"


def launch_reports(fd: int) -> Callable[[], str | None]:
    """Rank 0's ear for `meshlm launch` (--launch-fd) while the cluster starts: a worker that launch saw
    fail, as the line launch wrote, once it has; launch itself gone (its end of the pipe closed: killed,
    or its ssh cut); nothing while launch is silent."""
    try:
        os.set_blocking(fd, False)
    except OSError as exc:
        raise ClusterError(f"--launch-fd {fd}: {exc.strerror} (meshlm launch sets it; do not pass it yourself)") from None
    heard = bytearray()
    ended = False

    def gone() -> str | None:
        nonlocal ended
        try:
            data = os.read(fd, 4096)
            ended = ended or not data
            heard.extend(data[:4096 - len(heard)])
        except OSError:  # nothing written yet (BlockingIOError), or not a pipe after all
            pass
        line, newline, _ = heard.partition(b"\n")
        if newline:
            return f"{line.decode(errors='replace')} (reported by meshlm launch)"
        return LAUNCH_GONE if ended else None

    return gone


def stop_serving(why: str) -> None:
    """Stop this leader as SIGTERM would: it drains, then stops the workers."""
    log.error("%s: stopping", why)
    os.kill(os.getpid(), signal.SIGTERM)


def watch_launch(fd: int, stop: Callable[[str], None] = stop_serving, poll_seconds: float = 1.0) -> threading.Thread:
    """Once the cluster serves: `stop(why)` when `meshlm launch` is gone. Killed (SIGKILL, or its ssh cut),
    it left the whole cluster serving with no one to stop it; a worker's failure launch reports meanwhile
    is the control channel's to act on, so lines are only read past."""
    def run() -> None:
        while True:
            ready, _, _ = select.select([fd], [], [], poll_seconds)
            if not ready:
                continue
            try:
                data = os.read(fd, 4096)
            except BlockingIOError:
                continue
            except OSError:
                return
            if not data:
                stop(LAUNCH_GONE)
                return

    thread = threading.Thread(target=run, name="meshlm-launch-watch", daemon=True)
    thread.start()
    return thread


def start_watch(children: Sequence[subprocess.Popen], launch_fd: int | None) -> Callable[[], str | None] | None:
    """What rank 0 watches while its cluster starts, besides the control channel: the local workers it
    started, and `meshlm launch`'s reports of the ones it started (which may never connect)."""
    watches = ([lambda: exited(children)] if children else []) + \
        ([launch_reports(launch_fd)] if launch_fd is not None else [])
    if not watches:
        return None

    def gone() -> str | None:
        for watch in watches:
            why = watch()
            if why is not None:
                return why
        return None

    return gone


def exited(children: Sequence[subprocess.Popen]) -> str | None:
    """Why the cluster cannot form: the first local worker (rank r is children[r - 1]) that has exited."""
    for r, child in enumerate(children, start=1):
        code = child.poll()
        if code is not None:
            return f"rank {r} exited with status {code} before joining the cluster (its own output says why)"
    return None


def init_group(cfg: ParallelConfig, ring_file: Path | None, timeout: float):
    """Join the MLX group as `cfg.rank` (env set here so a child sees the same); the process ends (status 1,
    with the stack of the wait) if the group has not formed within `timeout` seconds (the caller watches
    for a rank that is gone meanwhile: join_watch.py). Raises ClusterError when this rank cannot join
    (its ring port is taken)."""
    import mlx.core as mx

    os.environ["MLX_RANK"] = str(cfg.rank)
    if cfg.backend == "ring" and ring_file is not None:
        os.environ["MLX_HOSTFILE"] = str(ring_file)
    if cfg.backend == "jaccl":
        os.environ["MLX_IBV_DEVICES"] = str(cfg.ibv_devices)
        os.environ["MLX_JACCL_COORDINATOR"] = str(cfg.jaccl_coordinator)
    log.info("joining the MLX group (%s) as rank %d of %d: this process ends if it has not formed within %.0f s",
             cfg.backend, cfg.rank, cfg.world_size, timeout)
    # The join cannot be interrupted and holds the GIL while it waits (rank 0 for ever for a rank that
    # died): only faulthandler's own thread, and the caller's watcher process, can end it.
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        group = mx.distributed.init(strict=True, backend=cfg.backend)
    except RuntimeError as exc:
        raise ClusterError(f"rank {cfg.rank} could not join the MLX group ({cfg.backend}): {exc}"
                           f"{_bind_hint(str(exc))}") from None
    finally:
        faulthandler.cancel_dump_traceback_later()
    if group.size() != cfg.world_size or group.rank() != cfg.rank:
        raise ClusterError(f"group is rank {group.rank()} of {group.size()}, expected {cfg.rank} of "
                           f"{cfg.world_size}: check the hostfile")
    return group


def _bind_hint(error: str) -> str:
    """What to fix when MLX's ring could not bind this rank's address ('Couldn't bind socket (error: N)')."""
    if "bind" not in error.lower():
        return ""
    code = re.search(r"error:? *(\d+)", error)
    if code is not None and int(code.group(1)) == errno.EADDRNOTAVAIL:
        return (": this rank's ring address is not an address of this machine (check its \"ips\" in the "
                "hostfile)")
    return ": another process holds this rank's ring address (a cluster still running? choose another --ring-port)"


def spawn_local_workers(argv: list[str], cluster: LocalCluster, n: int, secret: ClusterSecret,
                        log_dir: Path | None = None):
    """Start ranks 1..n-1 of a local cluster as `meshlm serve ... --rank r` children.

    The secret goes in their environment, never on a command line (which any local user can read)."""
    procs = []
    threads = str(max(1, (os.cpu_count() or 1) // n))
    for rank in range(1, n):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(cluster.hostfile),
               "OPENBLAS_NUM_THREADS": threads, SECRET_ENV: secret.reveal()}
        cmd = [*meshlm_command(), *argv, "--rank", str(rank),
               "--ring-hostfile", str(cluster.hostfile), "--control-addr", cluster.control_addr,
               "--stage-addrs", ",".join(cluster.stage_addrs)]
        out = open(log_dir / f"rank{rank}.log", "wb") if log_dir else None
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                      start_new_session=False))
    return procs
