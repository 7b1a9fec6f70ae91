"""The prefill server's side of disaggregated prefill: take jobs from decode servers on `--prefill-port`,
compute each prompt through the engine (batched with everything else it runs, its prefix cache
included), and stream the prompt's KV blocks back as they become final.

Each connection is one job on its own thread. The job's sequence is an ordinary
one that stops after one token (its sampled token is never sent: the decode
server samples the first token itself); its blocks reach this thread through
the engine's KV exporter on the engine thread, already encoded, so this thread
only writes bytes. A decode server that goes away aborts the job's sequence.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time

from meshlm.engine.engine import Engine, Export, PromptTooLong
from meshlm.engine.request import FinishReason, SamplingParams, StepOutput
from meshlm.engine.scheduler import QueueFull
from meshlm.kv.keys import CacheSalt, block_keys
from meshlm.metrics import Metrics
from meshlm.transport.handshakes import HandshakeSlots, RefusalLog
from meshlm.disagg.prefill_wire import (MAX_HANDSHAKES_PER_HOST, WAITING_SECONDS, Block, Conn, Done, Failed, Job,
                                        PeerInfo, PrefillWireError, Waiting, accept, block_packet)

log = logging.getLogger(__name__)

HANDSHAKE_SECONDS = 5.0
MAX_CONNECTIONS = 64  # jobs at once; more are refused (the decode server prefills them itself)
# Connections not yet authenticated, per address and in all: a stranger's hold only these (for up to
# HANDSHAKE_SECONDS each), never a job's place, and one address cannot take them all.
MAX_HANDSHAKES = 64
SMALL_MESSAGE_BYTES = 64 << 10


class PrefillService:
    def __init__(self, engine: Engine, info: PeerInfo, salt: CacheSalt, secret, host: str, port: int,
                 timeout: float, metrics: Metrics) -> None:
        self.engine = engine
        self.info = info
        self.salt = salt
        self.secret = secret
        self.timeout = timeout
        self.metrics = metrics
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._handshaking = HandshakeSlots(MAX_HANDSHAKES_PER_HOST, MAX_HANDSHAKES)
        self._refusals = RefusalLog(log, "prefill server: dropped a connection from %s: %s")
        self._closed = False
        # An IPv6 --host too, as the control channel and the stage links take one
        self._server = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._server.bind((host, port))
        except OSError as exc:
            self._server.close()
            raise ValueError(f"--prefill-port {port} on {host}: {exc}") from None
        self._server.listen(MAX_CONNECTIONS)
        self.port = self._server.getsockname()[1]

    def start(self) -> None:
        threading.Thread(target=self._accept_loop, name="meshlm-prefill-accept", daemon=True).start()
        log.info("taking prefill jobs on %s:%d", *self._server.getsockname()[:2])

    def close(self) -> None:
        self._closed = True
        self._refusals.close()
        try:
            self._server.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._server.accept()
            except OSError:
                return  # closed
            if not self._handshaking.take(addr[0]):
                self._refusals.refused(f"{addr[0]}:{addr[1]}", "too many connections still to authenticate")
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, addr[0], f"{addr[0]}:{addr[1]}"),
                             name="meshlm-prefill-job", daemon=True).start()

    def _serve(self, sock: socket.socket, host: str, peer: str) -> None:
        conn: Conn | None = None
        slot = False
        try:
            try:
                conn = accept(sock, peer, self.secret, HANDSHAKE_SECONDS)
            finally:
                self._handshaking.release(host)
            slot = self._slots.acquire(blocking=False)
            if not slot:
                outcome = self._refuse(conn, f"{MAX_CONNECTIONS} jobs already running")
            else:
                outcome = self._job(conn)
        except PrefillWireError as exc:
            log.warning("prefill job from %s ended: %s", peer, exc)
            outcome = "failed"
        except Exception:
            log.exception("prefill job from %s failed", peer)
            outcome = "failed"
        finally:
            if conn is not None:
                conn.close()
            else:
                sock.close()
            if slot:
                self._slots.release()
        self.metrics.disagg_jobs.labels(outcome=outcome).inc()

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    def _refuse(self, conn: Conn, reason: str) -> str:
        log.warning("prefill job from %s refused: %s", conn.peer, reason)
        conn.send_message(Failed(reason), self._deadline())
        return "refused"

    def _job(self, conn: Conn) -> str:
        theirs = conn.recv_message(self._deadline(), SMALL_MESSAGE_BYTES)
        if not isinstance(theirs, PeerInfo):
            return self._refuse(conn, f"expected the decode server's description, got {type(theirs).__name__}")
        why = self.info.mismatch(theirs)
        if why is not None:
            return self._refuse(conn, f"this server's KV cannot be restored there: {why}")
        conn.send_message(self.info, self._deadline())
        job = conn.recv_message(self._deadline())
        if not isinstance(job, Job):
            return self._refuse(conn, f"expected a job, got {type(job).__name__}")
        bs = self.salt.block_size
        blocks = len(job.token_ids) // bs
        if not job.token_ids or len(job.token_ids) % bs or not 0 <= job.first_block < blocks:
            return self._refuse(conn, f"a job must be whole blocks of {bs} tokens with first_block below their "
                                      f"count; got {len(job.token_ids)} tokens, first_block {job.first_block}")
        if not 0 <= job.job_id < 2**63:
            return self._refuse(conn, f"job id {job.job_id} is out of range")
        vocab = self.engine.vocab_size
        if vocab is not None and not (0 <= min(job.token_ids) and max(job.token_ids) < vocab):
            # before the keys are hashed: an id of 2**63 or more was an OverflowError there, no reply
            return self._refuse(conn, f"the job holds a token id outside the vocabulary (0..{vocab - 1})")
        return self._run(conn, job, block_keys(job.token_ids, self.salt))

    def _run(self, conn: Conn, job: Job, keys: list[bytes]) -> str:
        items: queue.Queue = queue.Queue()
        bs = self.salt.block_size

        def sink(index: int, data) -> None:  # the engine thread: encode there, MLX stays on one thread
            # the KV bytes, as the receiver counts them (the packet adds the stage wire's headers)
            kv_bytes = sum(a.nbytes for a in (*data.keys, *data.values))
            items.put(("block", index, *block_packet(job.job_id, index, bs, data), kv_bytes))

        def emit(out: StepOutput) -> None:
            if out.finish_reason is not None:
                items.put(("end", out))

        try:
            uid = self.engine.submit(job.token_ids, SamplingParams(max_tokens=1, temperature=0.0), emit,
                                     export=Export(job.first_block, sink))
        except (QueueFull, PromptTooLong, ValueError, RuntimeError) as exc:
            return self._refuse(conn, str(exc))
        sent = 0
        progress = time.monotonic()
        try:
            while True:
                try:
                    item = items.get(timeout=WAITING_SECONDS)
                except queue.Empty:
                    if time.monotonic() - progress > self.timeout:
                        self.engine.abort(uid)
                        return self._refuse(conn, f"no progress within {self.timeout:.0f} s")
                    conn.send_message(Waiting(), self._deadline())  # busy, not silent (or the client is gone)
                    continue
                progress = time.monotonic()
                if item[0] == "block":
                    _, index, packet, crc, kv_bytes = item
                    conn.send_message(Block(index, keys[index], crc), self._deadline())
                    conn.send(packet, self._deadline())
                    self.metrics.disagg_kv_bytes.labels(direction="sent").inc(kv_bytes)
                    sent += 1
                    continue
                out: StepOutput = item[1]
                if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT) or sent != len(keys) - job.first_block:
                    return self._refuse(conn, out.error or f"the job ended ({out.finish_reason.value}) after {sent} "
                                                           "blocks")
                conn.send_message(Done(sent), self._deadline())
                return "done"
        except PrefillWireError:
            self.engine.abort(uid)  # the decode server went away: stop computing for it
            raise
