"""Typed configuration, one frozen dataclass per concern, parsed once in the CLI.

Values derived at run time (the resolved dtype, the KV budget in tokens) live
on the objects that derive them, never written back here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _check_positive(flag: str, value: float, limit: float = 1e7) -> None:
    """A duration or size flag: a number > 0 and below `limit` (NaN and infinity are neither)."""
    if not 0 < value < limit:
        raise ValueError(f"{flag} must be a number > 0 (and below {limit:g}), got {value}")


def check_port(flag: str, port: int, count: int = 1) -> None:
    """`count` listening ports from `port` on (rank r's is port + r), each in 1..65535: port 0 would be any
    free one, which the ranks that must connect to it could not know."""
    if not 0 < port <= 65536 - count:
        span = f" (rank {count - 1}'s is {flag} + {count - 1})" if count > 1 else ""
        raise ValueError(f"{flag} must be in 1..{65536 - count}{span}, got {port}")


def split_addr(addr: str) -> tuple[str, int]:
    """HOST:PORT as (host, port): an IPv6 host is everything before the last ':', bracketed ([::1]:9000, as
    in a URL) or not (::1:9000). ValueError when it is not HOST:PORT."""
    host, _, port = addr.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdigit():
        raise ValueError(f"takes HOST:PORT, got {addr!r}")
    return host, int(port)


def check_address(flag: str, addr: str) -> None:
    """A HOST:PORT other ranks connect to (`split_addr`)."""
    try:
        _, port = split_addr(addr)
    except ValueError as exc:
        raise ValueError(f"{flag} {exc}") from None
    check_port(f"{flag}'s port", port)


@dataclass(frozen=True)
class ModelConfig:
    path: str = "demo"  # a HF-layout directory, or "demo" for SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: float32 on CPU, the model's own dtype on Metal/CUDA; on CPU 16-bit = weights only
    max_model_len: int | None = None  # None: the model's own context length
    served_name: str | None = None  # name reported by /v1/models; None: derived from path
    cpu_kernels: bool = True  # on CPU, base-2 attention and SwiGLU (model/cpu_kernels.py)
    native_kernels: bool = True  # ... as compiled C++ (csrc/cpu_ops.cpp) where `make install` built it
    # ... whose packed GEMM keeps a layer bfloat16 (or float16) when every weight of it is one (a 16-bit
    # checkpoint widened to float32 at load): half the memory and the bytes a decode step streams, same products
    half_weights: bool = True
    # ... and a step of decode rows runs each layer as four compiled nodes (model/decode_layer.py), same outputs
    fused_decode: bool = True
    adapter_path: str | None = None  # an mlx-lm fine-tuned adapter fused at load (model/adapters.py)
    # On CPU with the compiled kernels, the weights move into 2 MiB pages where Linux can (a decode step
    # streams them all: fewer TLB misses, longer prefetch runs), same outputs
    huge_pages: bool = True

    def __post_init__(self) -> None:
        if self.adapter_path is not None and not self.adapter_path.strip():
            raise ValueError("--adapter-path must not be empty")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.served_name is not None and not self.served_name.strip():
            raise ValueError("--served-model-name must not be empty")


AUTO_ON_OFF = ("auto", "on", "off")  # --async-scheduling, --cp-overlap, --local-all-reduce


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 32  # sequences running at once
    max_tokens_per_step: int = 1024  # prefill chunk tokens + decode tokens in one step (docs/BENCHMARKS.md)
    max_waiting: int = 256  # bounded waiting queue; beyond it requests get 429
    kv_cache_memory: int | None = None  # bytes for KV; None: a fraction of RAM
    # Plan decode steps while the previous one runs (engine.py, `_step_ahead`): on | off | auto (on when
    # the forward runs on a GPU; on a CPU the host's work competes with the forward for the same cores).
    async_scheduling: str = "auto"
    # A step does at most the work of a whole chunk starting at this context: later prompt chunks are
    # shorter (engine/step_work.py); 0: the token budget alone.
    long_prefill_context: int = 8192

    def __post_init__(self) -> None:
        if self.long_prefill_context < 0:
            raise ValueError("--long-prefill-context must be >= 0 (0: no limit)")
        for name in ("max_batch_size", "max_tokens_per_step", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_tokens_per_step < self.max_batch_size:
            raise ValueError("max_tokens_per_step must be >= max_batch_size (one decode token each)")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if self.async_scheduling not in AUTO_ON_OFF:
            raise ValueError(f"async_scheduling must be one of {', '.join(AUTO_ON_OFF)}")


DEFAULT_SSD_GB = 20.0


@dataclass(frozen=True)
class CacheConfig:
    """Prefix cache: RAM block pool (shares --kv-cache-memory with running sequences) and SSD tier."""

    enabled: bool = True
    block_size: int = 32  # 32 vs 16: same RAM hit time, ~20% faster SSD hits (docs/BENCHMARKS.md)
    ssd: bool = True
    cache_dir: str = "~/.cache/meshlm/kv"
    ssd_cache_gb: float | None = None  # a rank's SSD tier; None: DEFAULT_SSD_GB shared by a cluster's ranks here
    ssd_ttl_days: float = 7.0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.ssd_cache_gb is not None:
            _check_positive("--ssd-cache-gb", self.ssd_cache_gb)
        _check_positive("--ssd-ttl-days", self.ssd_ttl_days)
        if self.enabled and self.ssd and not self.cache_dir.strip():  # Path("") is the working directory
            raise ValueError("--kv-cache-dir must not be empty (--no-ssd-cache turns the SSD tier off)")

    def ssd_bytes(self, ranks_here: int = 1) -> int:
        """One rank's SSD tier: --ssd-cache-gb as given, else DEFAULT_SSD_GB shared by the `ranks_here` ranks of
        a cluster on this machine, whose tiers fill one disk (each took the whole default: 80 GB for CP=4)."""
        if self.ssd_cache_gb is not None:
            return int(self.ssd_cache_gb * 2**30)
        return int(DEFAULT_SSD_GB * 2**30) // ranks_here


SPECULATIVE_METHODS = ("off", "ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (docs/SPECULATIVE.md): who proposes, how far ahead, and when it is worth it."""

    method: str = "off"
    num_tokens: int = 5  # drafts per verify step (K); K + 1 = 6 rows: one pass of the CPU GEMM (8 with AVX-512)
    draft_model: str | None = None  # method "draft": an mlx-lm model directory with the target's tokenizer
    max_batch_size: int = 4  # decoding sequences above this: plain decoding (docs/BENCHMARKS.md)
    # n-gram proposer: shortest suffix looked up. 1, since a verify step costs little more than a plain one
    # and a weak draft is then cheap (input-grounded 1.66x -> 1.77-1.83x, docs/BENCHMARKS.md).
    ngram_min: int = 1
    ngram_max: int = 4  # ... longest (tried first)
    adaptive: bool = True  # stop speculating a sequence whose measured gain is below 1
    # n-gram drafts of a sequence whose last verify accepted every one double, up to this, and fall back
    # to K at the first rejection: text copied from the prompt is accepted in long runs. 0: 3 x K, at most
    # 15 (16 rows cost the demo model ~1.6x a decode step on the CPU, docs/BENCHMARKS.md).
    max_num_tokens: int = 0

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative must be one of {SPECULATIVE_METHODS}")
        if not 1 <= self.num_tokens <= 32:
            raise ValueError("--num-speculative-tokens must be in 1..32")
        if self.max_num_tokens and not self.num_tokens <= self.max_num_tokens <= 32:
            raise ValueError("--num-speculative-tokens-max must be in --num-speculative-tokens..32 (0: the default)")
        if self.max_batch_size < 1:
            raise ValueError("--speculative-max-batch-size must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError("n-gram sizes must satisfy 1 <= --ngram-min <= --ngram-max <= 16")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("--speculative draft needs --draft-model PATH")
        if self.method != "draft" and self.draft_model:  # accepted and ignored, it misled
            raise ValueError(f"--draft-model is for --speculative draft, not {self.method}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @property
    def grown_num_tokens(self) -> int:
        """The most drafts a verify step of one sequence takes once its drafts keep being accepted."""
        return self.max_num_tokens or max(self.num_tokens, min(3 * self.num_tokens, 15))


BACKENDS = ("ring", "jaccl", "mpi")
MAX_RANKS = 1024  # far beyond a cluster of Macs; a larger count only ever reached an OverflowError
# --step-timeout and --worker-timeout below this only end a healthy cluster: the watchdog looks every 0.5 s,
# an idle leader heartbeats every 0.5 s, and a step (a first request's compile, a 1,024-token prefill chunk
# on a CPU) takes longer than a fraction of a second. (0.000001 was accepted; the first request ended the cluster.)
MIN_CLUSTER_TIMEOUT = 1.0
CP_ALGORITHMS = ("auto", "pass-kv", "pass-q")


# A cluster over a hostfile listens on these (rank r's ring and stage link on the port + r); a local cluster
# picks free ports itself.
CONTROL_PORT, RING_PORT, STAGE_PORT = 52100, 52000, 52200


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor or pipeline parallelism: how many ranks, how they find each other, and every deadline."""

    tensor_parallel: int = 1
    backend: str = "ring"
    hostfile: str | None = None  # mlx.launch format; None with tensor_parallel > 1: spawn local ranks
    rank: int = 0
    control_addr: str | None = None  # leader's host:port for StepPlans; None: derived
    step_timeout: float = 60.0  # a forward outliving this is ended by the watchdog
    # A rank hearing nothing (not even a heartbeat) from another this long takes it for lost: a worker
    # its leader, which then exits; the leader a worker, which then ends the cluster's requests
    worker_timeout: float = 5.0
    heartbeat_interval: float = 0.5
    # Each round of a cluster's start: every rank answering the roll call, the MLX group's join, every
    # rank loaded after the leader (a big model on a slow disk may need more)
    start_timeout: float = 180.0
    ibv_devices: str | None = None  # jaccl: MLX_IBV_DEVICES
    jaccl_coordinator: str | None = None  # jaccl: MLX_JACCL_COORDINATOR host:port
    pipeline_parallel: int = 1  # stages, each a rank holding a range of layers (cluster/stages.py)
    pp_split: tuple[int, ...] | None = None  # layers per stage in pipeline order; None: even (or by memory)
    stage_addrs: tuple[str, ...] | None = None  # host:port each rank's stage link listens on; None: derived
    stage_port: int = STAGE_PORT  # with a hostfile: rank r's stage link listens on stage_port + r
    context_parallel: int = 1  # ranks holding the whole model, each a share of every sequence's KV
    cp_algorithm: str = "auto"  # auto | pass-kv | pass-q (model/context_batch.py)
    cp_min_tokens: int = 0  # sequences shorter than this keep their KV whole on one rank (kv/context_blocks.py)
    # pass-KV's gather on a second stream, beside the attention to the rank's own KV. auto: on where the
    # cores are not computing (a GPU) or a NIC moves the bytes (jaccl); on a CPU's TCP ring the transfer
    # is the same cores' work and overlapping it measured no gain (docs/BENCHMARKS.md)
    cp_overlap: str = "auto"
    # Tensor parallelism's sums through shared memory when every rank is on this machine
    # (transport/local_reduce.py). auto: where it applies (a loopback ring, the CPU, the module built)
    local_all_reduce: str = "auto"
    # Rank 0 under `meshlm launch`: the descriptor (its stdin) on which launch reports a worker that failed,
    # so a start waiting for it ends at once (cluster/launch.py)
    launch_fd: int | None = None

    def __post_init__(self) -> None:
        if min(self.tensor_parallel, self.pipeline_parallel, self.context_parallel) < 1:
            raise ValueError("--tensor-parallel, --pipeline-parallel and --context-parallel must be >= 1")
        if max(self.tensor_parallel, self.pipeline_parallel, self.context_parallel) > MAX_RANKS:
            raise ValueError(f"--tensor-parallel, --pipeline-parallel and --context-parallel must be <= {MAX_RANKS}")
        if sum(n > 1 for n in (self.tensor_parallel, self.pipeline_parallel, self.context_parallel)) > 1:
            raise ValueError("--tensor-parallel, --pipeline-parallel and --context-parallel cannot be combined yet: "
                             "choose one")
        if self.cp_algorithm not in CP_ALGORITHMS:
            raise ValueError(f"--cp-algorithm must be one of {CP_ALGORITHMS}")
        if self.cp_overlap not in AUTO_ON_OFF:
            raise ValueError(f"--cp-overlap must be one of {', '.join(AUTO_ON_OFF)}")
        if self.local_all_reduce not in AUTO_ON_OFF:
            raise ValueError(f"--local-all-reduce must be one of {', '.join(AUTO_ON_OFF)}")
        if self.cp_min_tokens < 0:
            raise ValueError(f"--cp-min-tokens must be >= 0, got {self.cp_min_tokens}")
        if self.cp_min_tokens and not self.context:
            raise ValueError("--cp-min-tokens needs --context-parallel 2 or more")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {BACKENDS}")
        check_port("--stage-port", self.stage_port, self.world_size)
        if self.control_addr is not None:
            check_address("--control-addr", self.control_addr)
        for addr in self.stage_addrs or ():
            check_address("--stage-addrs", addr)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside 0..{self.world_size - 1}")
        if self.pp_split is not None and len(self.pp_split) != self.pipeline_parallel:
            raise ValueError(f"--pp-split names {len(self.pp_split)} stages, --pipeline-parallel is "
                             f"{self.pipeline_parallel}")
        if self.backend == "jaccl" and (self.tensor_parallel > 1 or self.context) and not (self.ibv_devices and self.jaccl_coordinator):
            raise ValueError("the jaccl backend needs --ibv-devices (MLX_IBV_DEVICES) and --jaccl-coordinator "
                             "(MLX_JACCL_COORDINATOR host:port); see docs/DISTRIBUTED.md")
        for flag, seconds in (("--step-timeout", self.step_timeout), ("--worker-timeout", self.worker_timeout),
                              ("--start-timeout", self.start_timeout), ("heartbeat interval", self.heartbeat_interval)):
            _check_positive(flag, seconds)
        for flag, seconds in (("--step-timeout", self.step_timeout), ("--worker-timeout", self.worker_timeout)):
            if seconds < MIN_CLUSTER_TIMEOUT:
                raise ValueError(f"{flag} must be at least {MIN_CLUSTER_TIMEOUT:g} s (a healthy step or a late "
                                 f"heartbeat would end the cluster), got {seconds:g}")
        if self.heartbeat_interval >= self.worker_timeout:
            raise ValueError("heartbeat interval must be shorter than the worker timeout")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def context(self) -> bool:
        return self.context_parallel > 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def pipeline(self) -> bool:
        return self.pipeline_parallel > 1

    @property
    def layout(self) -> str:
        """TP and CP layouts; a pipeline's name also carries its split, known once the model is
        (StageLayout.name)."""
        return f"cp{self.context_parallel}" if self.context else f"tp{self.tensor_parallel}"


# A client silent this long before its first request or with a request head half sent loses the
# connection; with a body half sent it gets 408; not reading a response, the connection is aborted.
# Otherwise such connections hold sockets for ever, and enough of them use up the process's file
# descriptors (nginx waits 60 s for a head or a body too).
CLIENT_TIMEOUT_SECONDS = 60.0


API_KEY_ENV = "MESHLM_API_KEY"  # --api-key's default: kept out of the process list
REASONING_PARSERS = ("none", "qwen3", "deepseek_r1")  # vLLM's names; both mean api/reasoning.py's one rule


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_tokens_default: int = 512  # when a request names no max_tokens
    log_level: str = "info"
    max_request_bytes: int = 16 * 2**20  # larger bodies get 413 before they are parsed
    default_temperature: float | None = None  # None: the model's generation_config.json, else 1.0
    default_top_p: float | None = None
    client_timeout: float = CLIENT_TIMEOUT_SECONDS
    # Browser pages from these origins may call the API (CORS); none by default: any page the user visits
    # could otherwise drive a server on 127.0.0.1. "*": every origin (vLLM's and mlx-lm's default).
    allowed_origins: tuple[str, ...] = ()
    reasoning_parser: str = "none"  # api/reasoning.py: a thinking model's reasoning apart from its answer
    api_key: str | None = field(default=None, repr=False)  # api/auth.py; never in a log line
    chat_template: str | None = None  # Jinja text replacing the model's own (--chat-template)
    # Template variables for every chat request; a request's own chat_template_kwargs win.
    chat_template_kwargs: dict = field(default_factory=dict)
    shutdown_timeout: float = 2.0  # seconds a drain gives running requests (--shutdown-timeout)
    tool_call_parser: str = "auto"  # the syntax tool calls are read in (vLLM's names); auto: from the template

    def __post_init__(self) -> None:
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()
                                         or not self.api_key.isascii() or not self.api_key.isprintable()):
            raise ValueError("--api-key (or MESHLM_API_KEY) must be printable ASCII, without spaces around it")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}")
        from meshlm.model.chat_templates import check_tool_call_parser  # mlx-lm's parsers, listed lazily

        check_tool_call_parser(self.tool_call_parser)
        for origin in self.allowed_origins:
            if origin != "*" and not re.fullmatch(r"https?://[A-Za-z0-9.\-\[\]:]+", origin):
                raise ValueError(f"--allowed-origins: {origin[:80]!r} is not an origin (scheme://host[:port]) or *")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if self.max_tokens_default < 1:
            raise ValueError(f"--max-tokens-default must be >= 1, got {self.max_tokens_default}")
        if self.max_request_bytes < 1024:
            raise ValueError("--max-request-bytes must be at least 1024")
        if self.default_temperature is not None and not 0 <= self.default_temperature <= 2:
            raise ValueError("--default-temperature must be in [0, 2]")
        if self.default_top_p is not None and not 0 < self.default_top_p <= 1:
            raise ValueError("--default-top-p must be in (0, 1]")
        if not 0 < self.client_timeout <= 86400:
            raise ValueError("--client-timeout must be in (0, 86400] seconds")
        if not 0 <= self.shutdown_timeout <= 86400:
            raise ValueError("--shutdown-timeout must be in [0, 86400] seconds")


ROLES = ("serve", "prefill")


@dataclass(frozen=True)
class DisaggConfig:
    """Disaggregated prefill (docs/DISAGGREGATED.md): a prefill server computes long prompts' KV, the
    user-facing server receives it and decodes."""

    role: str = "serve"  # prefill: also take prefill jobs from decode servers on `prefill_port`
    prefill_port: int | None = None
    peers: tuple[str, ...] = ()  # host:port of prefill servers this server hands long prompts to
    min_tokens: int = 512  # hand off prompts with at least this many tokens not already cached here
    # A prefill peer silent this long within a job is given up (local prefill); so is a job running longer
    # than this plus this per 1,024 tokens it sends (disagg/prefill_client.py, TOKENS_PER_TIMEOUT).
    timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {ROLES}")
        if self.role == "prefill" and self.prefill_port is None:
            raise ValueError("--role prefill needs --prefill-port P (where decode servers send prefill jobs)")
        if self.role != "prefill" and self.prefill_port is not None:
            raise ValueError("--prefill-port is for --role prefill")
        if self.prefill_port is not None and not 0 < self.prefill_port < 65536:
            raise ValueError(f"--prefill-port out of range: {self.prefill_port}")
        if self.role == "prefill" and self.peers:
            raise ValueError("a --role prefill server takes prefill jobs; it does not hand them on (--prefill-peer)")
        for peer in self.peers:
            check_address("--prefill-peer", peer)
        if self.min_tokens < 1:
            raise ValueError("--disagg-min-tokens must be >= 1")
        _check_positive("--prefill-timeout", self.timeout)

    @property
    def enabled(self) -> bool:
        return self.role == "prefill" or bool(self.peers)


@dataclass(frozen=True)
class ServeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)

    def __post_init__(self) -> None:
        if self.parallel.context and self.cache.block_size % 2:  # kv/context_split.py: half a block a rank
            # checked here, not where the ring forms: that was after rank 1 had started, and said twice
            raise ValueError(f"context parallelism needs an even --block-size, got {self.cache.block_size}")
        if self.disagg.enabled and self.parallel.distributed:
            raise ValueError("disaggregated prefill (--role prefill, --prefill-peer) runs on single-process servers "
                             "for now; drop --tensor-parallel, --pipeline-parallel or --context-parallel")
        if self.disagg.peers and not self.cache.enabled:
            raise ValueError("--prefill-peer needs the prefix cache (received KV is found through it): "
                             "drop --no-prefix-cache")
        if self.disagg.prefill_port is not None and self.disagg.prefill_port == self.server.port:
            raise ValueError(f"--prefill-port and --port are both {self.server.port}: prefill jobs and HTTP "
                             "need a port each")
