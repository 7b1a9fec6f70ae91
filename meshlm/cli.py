"""The `meshlm` command line: parses arguments once into typed configs, then hands off."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path

from meshlm.config import (API_KEY_ENV, AUTO_ON_OFF, CLIENT_TIMEOUT_SECONDS, CONTROL_PORT, DTYPES, REASONING_PARSERS,
                           RING_PORT, STAGE_PORT, CacheConfig, DisaggConfig, ModelConfig, ParallelConfig,
                           SchedulerConfig, ServeConfig, ServerConfig, SpeculativeConfig)
from meshlm.process_exit import end_process

log = logging.getLogger("meshlm")


def parse_bytes(text: str) -> int:
    """'8GB', '512MiB', '1e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4GB or 512MiB)")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
    try:
        value = int(float(m.group(1)) * scale)
    except (ValueError, OverflowError):  # '1.2.3', or past a float ('1e400' is infinity)
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4GB or 512MiB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("size must be positive")
    return value


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model behind an OpenAI-compatible HTTP API")
    p.add_argument("--model", default="demo", help="HF-layout model directory, or 'demo' (SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="name reported by /v1/models")
    p.add_argument("--adapter-path", default=None,
                   help="an mlx-lm fine-tuned adapter directory (adapter_config.json, adapters.safetensors: "
                        "LoRA, DoRA or full), fused into the weights at load, as mlx_lm.server's --adapter-path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="auto: float32 on the CPU, the checkpoint's own on a GPU; on the CPU bfloat16 or float16 "
                        "rounds the weights to it (half the memory and weight reads) and computes in float32")
    p.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                   help="on CPU, keep mlx's own attention and SwiGLU instead of meshlm's faster base-2 ones")
    p.add_argument("--no-native-kernels", dest="native_kernels", action="store_false",
                   help="on CPU, run meshlm's kernels as MLX ops even where the compiled csrc/cpu_ops.cpp loads")
    p.add_argument("--no-half-weights", "--no-bf16-weights", dest="half_weights", action="store_false",
                   help="on CPU, hold every linear layer in float32, even where all its weights are exact "
                        "bfloat16 or float16 values (by default those stay 16-bit: half the memory and weight "
                        "reads)")
    p.add_argument("--no-fused-decode", dest="fused_decode", action="store_false",
                   help="on CPU, run a decode step's layers op by op instead of each as four compiled nodes "
                        "(same outputs; for comparison)")
    p.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                   help="on CPU, leave the weights in the 4 KiB pages they were loaded into instead of moving "
                        "them into 2 MiB transparent huge pages (same outputs; for comparison)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-tokens-per-step", type=int, default=1024,
                   help="prefill chunk + decode tokens per step (smaller: steadier streams, slower long prompts)")
    p.add_argument("--long-prefill-context", type=int, default=8192,
                   help="prompt chunks starting past this context are shortened so that a step does no more work "
                        "than a whole --max-tokens-per-step chunk starting here (attention grows with the context): "
                        "a step's length stops growing with the prompt, so streams keep flowing, and a step that fits "
                        "--step-timeout at this context fits it at any; 0: chunks of the token budget at any context "
                        "(default 8192)")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429")
    p.add_argument("--async-scheduling", choices=AUTO_ON_OFF, default="auto",
                   help="plan each decode step while the previous one runs, on its tokens still on the device "
                        "(one process, tensor parallelism); auto: only when the forward runs on a GPU, as on a "
                        "CPU the host's work takes cores from the forward (docs/BENCHMARKS.md). A pipeline plans ahead "
                        "whenever one micro-batch alone is in flight, its ids following the plan, unless off")
    p.add_argument("--max-tokens-default", type=int, default=512, help="max_tokens when a request names none")
    p.add_argument("--max-request-bytes", type=parse_bytes, default=16 * 2**20,
                   help="larger request bodies get 413 before they are parsed (default 16MiB)")
    p.add_argument("--client-timeout", type=float, default=CLIENT_TIMEOUT_SECONDS,
                   help="seconds a client may stay silent before its first request or with a request half sent "
                        "(closed; a half-sent body gets 408), or not read a response (aborted) (default 60)")
    p.add_argument("--shutdown-timeout", type=float, default=2.0,
                   help="seconds SIGTERM (or SIGINT, SIGHUP) gives running requests to finish before they end with "
                        "an error (default 2; a Kubernetes drain may want its terminationGracePeriodSeconds less "
                        "a few); a second signal ends them at once")
    p.add_argument("--allowed-origins", default="",
                   help="comma-separated origins (https://host:port) whose browser pages may call the API "
                        "(CORS), or *; none by default")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) replacing the model's own")
    p.add_argument("--tool-call-parser", default="auto",
                   help="the syntax tool calls are read in, whatever the chat template suggests: vLLM's names "
                        "(hermes, mistral, llama3_json, pythonic, qwen3_coder, ...) or an mlx-lm tool parser's; "
                        "auto (default): inferred from the template")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice auto is always on here")
    p.add_argument("--default-chat-template-kwargs", "--chat-template-args", dest="chat_template_kwargs",
                   default=None, help="a JSON object of chat template variables for every request, e.g. "
                                      "'{\"enable_thinking\": false}' (a request's chat_template_kwargs win)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help="clients must send `Authorization: Bearer KEY` (every route but /health, /metrics and "
                        f"/version); default ${API_KEY_ENV}, which other users cannot read in the process list")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default="none",
                   help="a thinking model's <think>...</think> goes to the chat message's reasoning_content "
                        "(as vLLM's parsers; qwen3 and deepseek_r1 mean the same rule)")
    p.add_argument("--default-temperature", type=float, default=None,
                   help="temperature for requests that name none (default: the model's generation_config.json, else 1)")
    p.add_argument("--default-top-p", type=float, default=None,
                   help="top_p for requests that name none (default: the model's generation_config.json, else 1)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="KV budget, e.g. 4GB")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn the block prefix cache off")
    p.add_argument("--block-size", type=int, default=32, help="tokens per prefix-cache block (docs/BENCHMARKS.md)")
    p.add_argument("--kv-cache-dir", default="~/.cache/meshlm/kv", help="root of the SSD tier")
    p.add_argument("--ssd-cache-gb", type=float, default=None,
                   help="GB of prefix blocks a rank keeps on disk (default 20, shared by a local cluster's ranks)")
    p.add_argument("--ssd-ttl-days", type=float, default=7.0)
    p.add_argument("--no-ssd-cache", action="store_true", help="keep prefix blocks in RAM only")
    g = p.add_argument_group("tensor parallelism (docs/DISTRIBUTED.md)")
    g.add_argument("--tensor-parallel", type=int, default=1, help="ranks; alone on one machine it starts them itself")
    g.add_argument("--backend", default="ring", choices=["ring", "jaccl", "mpi"])
    g.add_argument("--hostfile", default=None, help="mlx.launch hostfile: one {ssh, ips} entry per rank")
    g.add_argument("--rank", type=int, default=0, help="this process's rank (set by meshlm launch)")
    g.add_argument("--control-addr", default=None, help="leader host:port for StepPlans")
    g.add_argument("--control-port", type=int, default=None,
                   help=f"with --hostfile: the leader's control port (default {CONTROL_PORT})")
    g.add_argument("--ring-port", type=int, default=None,
                   help=f"with --hostfile: rank r's ring backend port is this + r (default {RING_PORT})")
    g.add_argument("--ring-hostfile", default=None, help=argparse.SUPPRESS)
    g.add_argument("--launch-fd", type=int, default=None, help=argparse.SUPPRESS)  # set by meshlm launch
    g.add_argument("--step-timeout", type=float, default=60.0, help="a forward outliving this ends the cluster")
    g.add_argument("--worker-timeout", type=float, default=5.0,
                   help="a rank hearing nothing (not even a heartbeat) from another this long takes it for lost: "
                        "a worker exits, the leader ends the cluster's requests")
    g.add_argument("--start-timeout", type=float, default=180.0,
                   help="seconds each round of a cluster's start may take: every rank answering the roll call, the "
                        "MLX group's join, every rank loaded after the leader (a rank that has not is named)")
    g.add_argument("--ibv-devices", default=None, help="jaccl: devices file (MLX_IBV_DEVICES)")
    g.add_argument("--jaccl-coordinator", default=None, help="jaccl: host:port (MLX_JACCL_COORDINATOR)")
    g.add_argument("--local-all-reduce", default="auto", choices=AUTO_ON_OFF,
                   help="sum through shared memory when every rank is on this machine (auto: where it applies, "
                        "on the CPU; off: the --backend's own all-reduce)")
    g = p.add_argument_group("pipeline parallelism (docs/PIPELINE.md)")
    g.add_argument("--pipeline-parallel", type=int, default=1,
                   help="stages, each a rank holding a range of layers; alone on one machine it starts them itself")
    g.add_argument("--pp-split", default=None, help="layers per stage in pipeline order, e.g. 10,20 (default: even)")
    g.add_argument("--stage-port", type=int, default=None,
                   help=f"with --hostfile: rank r's stage link port is this + r (default {STAGE_PORT})")
    g.add_argument("--stage-addrs", default=None, help=argparse.SUPPRESS)
    g = p.add_argument_group("context parallelism (docs/CONTEXT_PARALLEL.md)")
    g.add_argument("--context-parallel", type=int, default=1,
                   help="ranks, each holding the whole model and its share of every sequence's KV")
    g.add_argument("--cp-algorithm", default="auto", choices=["auto", "pass-kv", "pass-q"],
                   help="ring attention: pass KV or queries between ranks (auto: chosen per step; decode steps "
                        "run every token on every rank and gather only the partial outputs)")
    g.add_argument("--cp-min-tokens", type=int, default=0,
                   help="sequences shorter than this keep their KV whole on one rank, chosen by load (0: split all)")
    g.add_argument("--cp-overlap", default="auto", choices=AUTO_ON_OFF,
                   help="pass-KV: gather the other ranks' KV on a second stream while attending to this rank's own "
                        "(auto: on a GPU or with jaccl)")
    g = p.add_argument_group("speculative decoding (docs/SPECULATIVE.md)")
    g.add_argument("--speculative", default=None, choices=["off", "ngram", "draft"],
                   help="propose tokens from the sequence's own n-grams or a draft model; the target verifies them "
                        "(default: off, or draft with --draft-model, as mlx_lm.server)")
    g.add_argument("--num-speculative-tokens", type=int, default=5, help="drafts per verify step (K)")
    g.add_argument("--num-speculative-tokens-max", type=int, default=0,
                   help="n-gram: a sequence whose drafts were all accepted drafts twice as many next time, up to "
                        "this (0: 3 x K, at most 15; K: never more than K)")
    g.add_argument("--draft-model", default=None,
                   help="model directory with the same tokenizer, whose drafts the target verifies (--speculative draft)")
    g.add_argument("--speculative-max-batch-size", type=int, default=4,
                   help="with more decoding sequences than this, a step decodes plainly")
    g.add_argument("--ngram-min", type=int, default=1, help="n-gram proposer: shortest suffix matched")
    g.add_argument("--ngram-max", type=int, default=4, help="n-gram proposer: longest suffix matched (tried first)")
    g.add_argument("--no-adaptive-speculation", dest="adaptive_speculation", action="store_false",
                   help="speculate even for sequences whose drafts are not paying off")
    g = p.add_argument_group("disaggregated prefill (docs/DISAGGREGATED.md)")
    g.add_argument("--role", default="serve", choices=["serve", "prefill"],
                   help="prefill: also compute prompts' KV for decode servers, on --prefill-port")
    g.add_argument("--prefill-port", type=int, default=None, help="--role prefill: port for prefill jobs")
    g.add_argument("--prefill-peer", action="append", default=[], metavar="HOST:PORT",
                   help="a prefill server to hand long prompts to (repeat for several)")
    g.add_argument("--disagg-min-tokens", type=int, default=512,
                   help="hand off prompts with at least this many tokens not already cached here")
    g.add_argument("--prefill-timeout", type=float, default=30.0,
                   help="a prefill peer silent this long within a job is given up, and so is a job running longer "
                        "than this plus this per 1,024 tokens it sends (the prompt is prefilled here)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _demo_parser(sub) -> None:
    p = sub.add_parser("demo-model", help="write the demo model (or a tiny random one) as a HF directory")
    p.add_argument("out", type=Path)
    p.add_argument("--tiny", action="store_true", help="tiny random-weight model with an offline tokenizer")
    p.add_argument("--model-type", default="llama", choices=["llama", "qwen2", "qwen3"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-position", type=int, default=4096, help="tiny model's context window (tokens)")
    p.add_argument("--vocab", type=int, default=None, help="tiny model's vocabulary (default: its tokenizer's, 512)")
    p.add_argument("--tied", action="store_true", help="tiny model's LM head is its embedding table")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="how the weights are stored (the demo model's, or the tiny model's)")


def _launch_parser(sub) -> None:
    p = sub.add_parser("launch", help="start a multi-host cluster: one `meshlm serve --rank r` per hostfile entry")
    p.add_argument("--hostfile", required=True, help="mlx.launch format: [{\"ssh\": ..., \"ips\": [...]}]")
    p.add_argument("--backend", default="ring", choices=["ring", "jaccl", "mpi"])
    p.add_argument("--dry-run", action="store_true", help="print each rank's command instead of running it")
    p.add_argument("serve_argv", nargs=argparse.REMAINDER, help="-- serve [serve options]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshlm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _launch_parser(sub)
    _demo_parser(sub)
    return parser


def _world_size(args: argparse.Namespace) -> int:
    """--tensor-parallel, or with only --hostfile, one rank per hostfile entry."""
    if args.hostfile and args.tensor_parallel == 1 and args.pipeline_parallel == 1 and args.context_parallel == 1:
        from meshlm.cluster.bootstrap import read_hostfile

        return len(read_hostfile(args.hostfile))
    return args.tensor_parallel


MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def _rank(args: argparse.Namespace) -> int:
    """--rank, or under mpirun (--backend mpi) the rank MPI gave this process."""
    if args.backend == "mpi" and args.rank == 0:
        for var in MPI_RANK_VARS:
            if var in os.environ:
                return int(os.environ[var])
    return args.rank


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template given inline (as vLLM's flag)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # an inline template is no file name (too long, a NUL)
        is_file = False
    if is_file:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value}: cannot read it: {exc}") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template {value[:80]!r} is neither a file nor a Jinja template")
    # Compiled as transformers will render it (its loop controls and {% generation %} tag included),
    # before the model loads: a typo costs seconds, not minutes.
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: line {exc.lineno}: {exc.message}") from None
    return text


def _template_kwargs(value: str | None) -> dict:
    """--default-chat-template-kwargs: a JSON object of template variables, none of them meshlm's own."""
    if value is None:
        return {}
    from meshlm.api.schemas import _TEMPLATE_ARGUMENTS

    try:
        kwargs = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"--default-chat-template-kwargs is not JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise ValueError("--default-chat-template-kwargs must be a JSON object")
    taken = sorted(set(kwargs) & _TEMPLATE_ARGUMENTS)
    if taken:
        raise ValueError(f"--default-chat-template-kwargs may not set {', '.join(taken)}: requests say those")
    return kwargs


# Ports a cluster over a hostfile listens on; a local cluster picks free ones on 127.0.0.1 itself.
HOSTFILE_PORTS = {"control_port": ("--control-port", CONTROL_PORT), "ring_port": ("--ring-port", RING_PORT),
                  "stage_port": ("--stage-port", STAGE_PORT)}


def _hostfile_ports(args: argparse.Namespace) -> None:
    """Fill in the defaults; refuse the flags where nothing would listen on them (they were ignored)."""
    given = [flag for name, (flag, _) in HOSTFILE_PORTS.items() if getattr(args, name) is not None]
    if given and args.hostfile is None and args.ring_hostfile is None and args.control_addr is None:
        verb = "applies" if len(given) == 1 else "apply"
        raise ValueError(f"{' and '.join(given)} only {verb} with --hostfile: a local cluster picks free ports on "
                         "127.0.0.1 itself (drop the flag, or list the ranks in a hostfile)")
    for name, (_, default) in HOSTFILE_PORTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    _hostfile_ports(args)
    args.tensor_parallel = _world_size(args)
    args.rank = _rank(args)
    return ServeConfig(
        model=ModelConfig(args.model, args.dtype, args.max_model_len, args.served_model_name, args.cpu_kernels,
                          args.native_kernels, args.half_weights, args.fused_decode, args.adapter_path,
                          args.huge_pages),
        scheduler=SchedulerConfig(args.max_batch_size, args.max_tokens_per_step, args.max_queue, args.kv_cache_memory,
                                  args.async_scheduling, args.long_prefill_context),
        cache=CacheConfig(not args.no_prefix_cache, args.block_size, not args.no_ssd_cache, args.kv_cache_dir,
                          args.ssd_cache_gb, args.ssd_ttl_days),
        parallel=ParallelConfig(args.tensor_parallel, args.backend, args.hostfile, args.rank, args.control_addr,
                                args.step_timeout, args.worker_timeout, start_timeout=args.start_timeout,
                                ibv_devices=args.ibv_devices,
                                jaccl_coordinator=args.jaccl_coordinator, pipeline_parallel=args.pipeline_parallel,
                                pp_split=_ints(args.pp_split, "--pp-split"),
                                stage_addrs=tuple(args.stage_addrs.split(",")) if args.stage_addrs else None,
                                stage_port=args.stage_port, context_parallel=args.context_parallel,
                                cp_algorithm=args.cp_algorithm, cp_min_tokens=args.cp_min_tokens,
                                cp_overlap=args.cp_overlap, local_all_reduce=args.local_all_reduce,
                                launch_fd=args.launch_fd),
        server=ServerConfig(args.host, args.port, args.max_tokens_default, args.log_level, args.max_request_bytes,
                            args.default_temperature, args.default_top_p, args.client_timeout,
                            tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
                            args.reasoning_parser, args.api_key, _chat_template(args.chat_template),
                            _template_kwargs(args.chat_template_kwargs), args.shutdown_timeout,
                            args.tool_call_parser),
        speculative=SpeculativeConfig(args.speculative or ("draft" if args.draft_model else "off"),
                                      args.num_speculative_tokens, args.draft_model,
                                      args.speculative_max_batch_size, args.ngram_min, args.ngram_max,
                                      args.adaptive_speculation, args.num_speculative_tokens_max),
        disagg=DisaggConfig(args.role, args.prefill_port, tuple(args.prefill_peer), args.disagg_min_tokens,
                            args.prefill_timeout),
    )


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None


def _demo_model(args: argparse.Namespace) -> None:
    from meshlm.model.demo import export_demo, make_tiny

    try:
        if args.tiny:
            out = make_tiny(args.out, args.model_type, args.layers, args.hidden, args.heads, args.kv_heads,
                            vocab=args.vocab, seed=args.seed, max_position=args.max_position, dtype=args.dtype,
                            tied=args.tied)
        else:
            out = export_demo(args.out, args.dtype)
    except OSError as exc:  # OUT is a file, unwritable, on a full disk: the sentence, not a traceback
        raise ValueError(f"cannot write the model to {args.out}: {exc.strerror or exc}") from None
    print(out)


def _serve(config: ServeConfig, argv: list[str], ports) -> None:
    """Rank 0 binds its HTTP port before anything loads (api/listener.py); a local cluster's other ranks
    start before this process imports the serving stack, and import theirs meanwhile (begin_cluster)."""
    from meshlm.api import listener
    from meshlm.cluster.ranks import begin_cluster, start_cluster
    from meshlm.platform import interrupt_deferred

    sock = listener.bind(config.server.host, config.server.port) if config.parallel.rank == 0 else None
    try:
        with begin_cluster(config, argv, ports) as start:
            if start is not None and config.parallel.rank != 0:
                start_cluster(config, start)  # a worker rank needs no HTTP stack, and never returns
            with interrupt_deferred():  # the serving stack's imports: pydantic-core swallowed a Ctrl-C in its init
                from meshlm.app import serve

            serve(config, sock, start)
    finally:
        if sock is not None:
            sock.close()


def log_format(rank: int | None) -> str:
    """Rank 0's lines as a single server's; another rank's say which it is (a local cluster's ranks share
    one terminal, and a model that cannot load was reported by each rank alike), after the time, so a
    line still reads '... ERROR meshlm: ...'."""
    tag = f"rank {rank} " if rank else ""
    return f"%(asctime)s {tag}%(levelname)s %(name)s: %(message)s"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    from meshlm import transformers_index
    from meshlm.platform import cache_root, sigterm_as_interrupt

    transformers_index.install(cache_root() / "transformers-index")  # before anything imports transformers
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(), format=log_format(getattr(args, "rank", 0)))
    from meshlm.cluster.bootstrap import ClusterError

    try:
        if args.command == "serve":
            sigterm_as_interrupt()
            config = serve_config(args)
            if config.parallel.distributed and config.parallel.hostfile is None:
                # All local ranks share this machine's cores, rank 0 included (set before the re-exec).
                os.environ.setdefault("OPENBLAS_NUM_THREADS",
                                      str(max(1, (os.cpu_count() or 1) // config.parallel.world_size)))
            from meshlm.platform import interrupt_deferred, maybe_reexec_with_openblas

            maybe_reexec_with_openblas(argv)
            with interrupt_deferred():  # the first import of MLX and of meshlm's native modules
                from meshlm.cluster.ranks import ClusterPorts

            _serve(config, argv, ClusterPorts(args.control_port, args.ring_port, args.ring_hostfile))
        elif args.command == "launch":
            from meshlm.cluster.launch import launch

            serve_argv = args.serve_argv[1:] if args.serve_argv[:1] == ["--"] else args.serve_argv
            sys.exit(launch(args.hostfile, args.backend, serve_argv, args.dry_run))
        elif args.command == "demo-model":
            _demo_model(args)
    except (ValueError, FileNotFoundError, ClusterError) as exc:
        log.error("%s", exc)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C before serving began (once serving, it is an orderly stop)
        log.error("interrupted")
        end_process(130)
