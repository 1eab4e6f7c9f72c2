"""Every setting of the serving commands, once: one frozen dataclass per topic, each field with its default, help,
choices, bounds and environment variable. The commands (shared.settings.commands) say which topics they offer."""

import dataclasses
from typing import ClassVar

from shared.settings.options import option

DTYPES = ("auto", "float32", "bfloat16", "float16")
DRAFT_SAMPLING = ("dense", "sparse", "greedy")  # draft_worker.local_proposer.DraftSampling's values
MAX_BODY_HELP = ("the largest request body accepted, in MiB (a larger one gets a 413 before it is read; default: "
                 "32 bytes a token of the context, at least 4 MiB)")

frozen = dataclasses.dataclass(frozen=True, kw_only=True)


@frozen
class ModelSettings:
    TITLE: ClassVar[str] = "model"
    target: str | None = option(None, "target checkpoint folder (dflash-serve and dflash-generate: the embedded demo "
                                      "pair when none is given)", env="DFLASH_TARGET")
    draft: str | None = option(None, "drafter checkpoint folder; its config.json names the target layers it taps "
                                     "(with the demo target: the demo drafter when none is given)", env="DFLASH_DRAFT")
    no_draft: bool = option(False, "serve without a drafter (plain decoding)")
    device: str = option("cpu", "cpu or cuda (at tensor parallelism > 1 a bare cuda gives rank R the GPU R mod the "
                                "host's GPUs)", env="DFLASH_DEVICE")
    dtype: str = option("auto", "weights and activations of both workers: float32, bfloat16, float16, or auto (the "
                                "checkpoint's dtype; on CPU float32 where the C++ kernels run, a bfloat16 checkpoint's "
                                "projections in bfloat16 on AMX, else bfloat16 only where it is native, else float32)",
                        choices=DTYPES)
    block_size: int | None = option(None, "the drafter's block: draft tokens per step + 1 (default: the drafter's "
                                          "config)", minimum=2)
    max_model_len: int | None = option(None, "the context: prompt plus output tokens (default and cap: the target's "
                                             "max_position_embeddings)", minimum=1)


@frozen
class EngineSettings:
    TITLE: ClassVar[str] = "batching, memory and compute (verify worker)"
    max_running: int = option(64, "requests holding a KV-cache slot at once (the batch's cap; lowered to fit "
                                  "--kv-cache-budget-mb)", minimum=1)
    max_waiting: int = option(64, "requests queued for a slot; more get 429", minimum=0)
    max_prefill_tokens: int = option(512, "prompt tokens prefilled per step", minimum=1)
    kv_cache_budget_mb: float | None = option(None, "cap on the memory requests hold in the verify worker (its KV "
                                                    "cache and the feature rows kept for the drafter): --max-running "
                                                    "is lowered to fit (an error if one request does not)", above=0)
    gpu_memory_gb: float | None = option(None, "one GPU's memory in GB for the memory plan (default: the device's "
                                               "own; lets --plan plan for GPUs this machine lacks)", above=0)
    cpu_memory_gb: float | None = option(None, "on a CPU, the memory in GB the server's roles may use together, for "
                                               "the memory plan (default: what the host has available, or its "
                                               "cgroup's limit where lower, read as the server starts)", above=0,
                                         env="DFLASH_CPU_MEMORY_GB")
    no_prefix_caching: bool = option(False, "turn automatic prefix caching off: by default a finished request's "
                                            "cache slot keeps its prompt and output, and a later prompt that begins "
                                            "with them (an agent resending its history) prefills only the rest, the "
                                            "prefix copied into its slot or the kept slot taken (families with a "
                                            "positional cache: Qwen3, Llama, GLM-5.2; not GLM-5.3's recurrent "
                                            "state)")
    stall_timeout: float = option(300.0, "a verify loop that makes no progress for this long is hung: the worker "
                                         "tells the gateway and exits (0 = never); heartbeats flow meanwhile, whatever "
                                         "a step takes", minimum=0, env="DFLASH_STALL_TIMEOUT")
    cuda_graphs: bool = option(False, "replay decode steps from CUDA graphs, one per shape bucket (rows padded to a "
                                      "power of two, a verify step to the block size, keys to a power of two), all "
                                      "captured at start-up (--device cuda, tensor parallelism 1)")
    batch_invariant: bool = option(False, "on a GPU, the target's projections, norms and attention through cuda_ext's "
                                          "row kernels (a row's sums never depend on the batch), for greedy "
                                          "speculative output equal to plain decoding (--device cuda, bfloat16, "
                                          "tensor parallelism 1, a Qwen3/Llama target; not yet run on a GPU)")


@frozen
class SpeculationSettings:
    TITLE: ClassVar[str] = "speculation"
    spec_policy: str = option("adaptive", "adaptive: decode plainly while drafting is expected not to pay at the "
                                          "batch size (a drafted step after 8 plain ones, and rarer where such probes "
                                          "would cost over 5% of the time, re-measures it; a drafting step asks "
                                          "for the full block or about half of it, whichever commits tokens faster; "
                                          "steps with a seeded sampled request always draft); always: every step "
                                          "drafts the full block",
                              choices=("always", "adaptive"), env="DFLASH_SPEC_POLICY")
    draft_placement: str = option("worker", "worker: a draft worker process (at --draft-addr); local: the drafter "
                                            "runs inside the verify worker (no draft call between processes; a "
                                            "drafter fault then stops the verify worker)",
                                  choices=("worker", "local"), env="DFLASH_DRAFT_PLACEMENT")
    draft_sampling: str = option("dense", "how the drafter proposes for sampled requests (all three are lossless)",
                                 choices=DRAFT_SAMPLING)
    grammar_drafts: str = option("forced", "drafts of a constrained request (all are exact): forced: the tokens its "
                                           "grammar forces where it forces some, else the drafter's, cut at the first "
                                           "one the grammar refuses; masked: the same, the drafter drafting under the "
                                           "grammar; drafted: the drafter drafting under the grammar, forced tokens "
                                           "included, every step it drafts; cut, target: for measurement "
                                           "(docs/benchmarks.md)",
                                 choices=("forced", "masked", "drafted", "cut", "target"))
    draft_timeout: float = option(5.0, "the longest wait for a draft (a fresh drafter waits it until 4 calls are "
                                       "answered); other calls wait 8x their recent median plus their extra context "
                                       "rows at the measured cost of a row, at least --draft-deadline-floor; a "
                                       "drafter that closes its connection is noticed at once", above=0)
    draft_deadline_floor: float = option(0.25, "the shortest deadline of a steady draft call (seconds)", above=0)


@frozen
class DraftWorkerSettings:
    TITLE: ClassVar[str] = "draft worker"
    max_requests: int = option(64, "requests whose drafter context stays cached at once (keep >= the verify "
                                   "worker's --max-running)", minimum=1)


@frozen
class TransportSettings:
    TITLE: ClassVar[str] = "feature transport (verify rank 0 -> draft worker; both ends must agree)"
    feature_transport: str = option("frames", "how hidden states reach the drafter: in the ZeroMQ message (frames), "
                                              "or a torch.distributed pair (NCCL when both workers run on CUDA)",
                                    choices=("frames", "pair"), env="DFLASH_FEATURE_TRANSPORT")
    feature_pair_addr: str | None = option(None, "HOST:PORT of the pair's rendezvous store, hosted by the verify "
                                                 "worker", env="DFLASH_FEATURE_PAIR_ADDR")
    feature_pair_backend: str = option("auto", "the pair's backend (auto: nccl on CUDA, gloo on CPU)",
                                       choices=("auto", "gloo", "nccl"))
    feature_pair_timeout: float = option(5.0, "seconds a pair rendezvous or transfer may take before the drafter "
                                              "counts as down", above=0)


@frozen
class ChannelSettings:
    TITLE: ClassVar[str] = "sockets between the processes"
    requests_addr: str = option("tcp://127.0.0.1:5555", "ZeroMQ address of requests and aborts (bound by the verify "
                                                        "worker)", env="DFLASH_REQUESTS_ADDR")
    events_addr: str = option("tcp://127.0.0.1:5556", "ZeroMQ address of token events (bound by the verify worker)",
                              env="DFLASH_EVENTS_ADDR")
    draft_addr: str = option("tcp://127.0.0.1:5557", "ZeroMQ address of draft calls (bound by the draft worker)",
                             env="DFLASH_DRAFT_ADDR")


@frozen
class MetricsSettings:
    TITLE: ClassVar[str] = "metrics"
    metrics_port: int = option(9101, "Prometheus port (0 = none)", minimum=0, env="DFLASH_{role}_METRICS_PORT")
    metrics_host: str = option("127.0.0.1", "address the Prometheus port binds", env="DFLASH_METRICS_HOST")


@frozen
class ThreadSettings:
    TITLE: ClassVar[str] = "threads"
    threads: int = option(0, "PyTorch's threads (0: half the cores for the verify worker, a quarter for the draft "
                             "worker; in dflash-generate 1 where the C++ CPU kernels run, else PyTorch's own)",
                          minimum=0, env="DFLASH_{role}_THREADS")
    kernel_threads: int = option(0, "threads of the C++ CPU kernels, where they run (0: every core the process may "
                                    "use; a busy core's thread takes no share, the caller does its parts)",
                                 minimum=0, env="DFLASH_{role}_KERNEL_THREADS")


@frozen
class ParallelSettings:
    TITLE: ClassVar[str] = "tensor parallelism (one verify process per rank; rank 0 owns the sockets)"
    world_size: int = option(1, "tensor-parallel size: ranks over all hosts (dflash-serve starts them all here)",
                             minimum=1, env="DFLASH_TP_WORLD_SIZE", aliases=("--tp",))
    rank: int = option(0, "this process's rank", minimum=0, env="DFLASH_TP_RANK")
    master_addr: str = option("127.0.0.1", "address of rank 0, reachable from every rank", env="DFLASH_TP_MASTER_ADDR")
    master_port: int = option(29500, "port of the group's rendezvous at --master-addr", minimum=1,
                              env="DFLASH_TP_MASTER_PORT")
    tp_backend: str = option("auto", "auto = nccl on CUDA, gloo on CPU", choices=("auto", "gloo", "nccl"),
                             env="DFLASH_TP_BACKEND")
    collective_timeout: float = option(30.0, "seconds a tensor-parallel collective may wait for a rank before the "
                                             "verify worker fails", above=0, env="DFLASH_TP_TIMEOUT",
                                       aliases=("--tp-timeout",))


@frozen
class HttpSettings:
    TITLE: ClassVar[str] = "HTTP API (gateway)"
    host: str = option("127.0.0.1", "HTTP bind address", env="DFLASH_HOST")
    port: int = option(8000, "HTTP port of the OpenAI API", minimum=0, env="DFLASH_PORT")
    served_model_name: str | None = option(None, "the model name clients send (default: the target folder's name; "
                                                 "dflash-demo for the demo pair)", env="DFLASH_MODEL_NAME")
    api_key: str | None = option(None, "require Authorization: Bearer KEY on the API (default: none)",
                                 env="DFLASH_API_KEY")
    max_pending: int = option(64, "requests in flight before 429 (dflash-serve: --max-running + --max-waiting)",
                              minimum=1)
    default_max_tokens: int = option(256, "max_tokens of a request that sends none (at most what its context "
                                          "leaves)", minimum=1)
    max_body_mb: float | None = option(None, MAX_BODY_HELP, above=0)
    tool_call_parser: str = option("auto", "how tool calls are read from a chat answer: hermes (Qwen3: <tool_call> "
                                           "JSON), glm45 / glm47 (GLM's <arg_key>/<arg_value> calls, spaced or "
                                           "compact), none (tools refused); auto: GLM's where the chat template "
                                           "writes <arg_key>, else hermes",
                                   choices=("auto", "hermes", "glm45", "glm47", "none"))
    reasoning_parser: str = option("auto", "think: a chat answer's <think>...</think> section goes to "
                                           "reasoning_content (also where the chat template opened it); none: left "
                                           "in content; auto: think where the chat template writes <think>",
                                   choices=("auto", "think", "none"))
    shutdown_timeout: float = option(30.0, "on SIGTERM, seconds the gateway lets requests in flight finish (new "
                                           "connections are refused meanwhile) before they are cut and the workers "
                                           "stop; Ctrl-C stops at once", minimum=0, env="DFLASH_SHUTDOWN_TIMEOUT")


@frozen
class ServeSettings:
    TITLE: ClassVar[str] = "processes (dflash-serve)"
    zmq_base_port: int = option(5555, "ports N (requests), N+1 (token events), N+2 (draft calls) on 127.0.0.1",
                                minimum=1)
    metrics_base_port: int = option(9101, "Prometheus ports: N (verify worker), N+1 (draft worker); the gateway "
                                          "serves /metrics", minimum=1)
    tp_master_port: int | None = option(None, "port of the tensor-parallel group's rendezvous (default: "
                                              "--zmq-base-port + 3)", minimum=1)
    feature_pair_port: int | None = option(None, "rendezvous port of the feature pair (default: --zmq-base-port + "
                                                 "4)", minimum=1)
    ready_timeout: float = option(600.0, "seconds the processes together may take to load and report ready",
                                  above=0)
    plan: bool = option(False, "print the verify worker's memory plan, read from config.json alone, and exit: 0 when "
                               "--max-running requests at the context fit each GPU, 1 when not (naming what would)")
