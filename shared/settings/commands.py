"""The serving commands' settings: which topics each offers, and the rules between settings that no single bound
says. dflash-serve builds each child's settings from its own and hands them over as JSON (options.to_json)."""

import dataclasses

from shared.settings.options import SettingsError, topic
from shared.settings.topics import (
    ChannelSettings,
    DraftWorkerSettings,
    EngineSettings,
    HttpSettings,
    MetricsSettings,
    ModelSettings,
    ParallelSettings,
    ServeSettings,
    SpeculationSettings,
    ThreadSettings,
    TransportSettings,
)

frozen = dataclasses.dataclass(frozen=True, kw_only=True)


def _stall_rule(engine: EngineSettings, longest_wait: float) -> None:
    if engine.stall_timeout and engine.stall_timeout <= 2 * longest_wait:
        raise SettingsError(f"--stall-timeout ({engine.stall_timeout:g} s) must exceed twice the longest wait of a "
                            f"step (--draft-timeout / --collective-timeout: {longest_wait:g} s), or be 0")


def _cuda_rules(model: ModelSettings, engine: EngineSettings, world_size: int) -> None:
    """--cuda-graphs and --batch-invariant need CUDA and TP 1 (a worker also asks the device itself: whether
    CUDA is there, and whether the kernels are built: verify_worker.target_loader.batch_invariant_refusal)."""
    on_cuda = str(model.device).startswith("cuda")
    if engine.cuda_graphs and not on_cuda:
        raise SettingsError(f"--cuda-graphs needs a CUDA device (--device cuda), not {model.device!r}")
    if engine.cuda_graphs and world_size > 1:
        raise SettingsError("--cuda-graphs needs --tp 1 (the other ranks mirror each step eagerly)")
    if engine.batch_invariant and (not on_cuda or world_size > 1):
        raise SettingsError("--batch-invariant needs --device cuda and --tp 1 (on CPU the default path, "
                            "the C++ kernels, is row-invariant already; at TP > 1 an all-reduce's order depends on "
                            "the message size)")


def _placement_rule(speculation: SpeculationSettings, world_size: int) -> None:
    if speculation.draft_placement == "local" and world_size > 1:
        raise SettingsError("--draft-placement local needs --tp 1 (the drafter needs the whole lm_head)")


@frozen
class VerifyCommand:
    """dflash-verify-worker."""
    model: ModelSettings = topic()
    engine: EngineSettings = topic()
    speculation: SpeculationSettings = topic()
    transport: TransportSettings = topic()
    channels: ChannelSettings = topic()
    metrics: MetricsSettings = topic(env_role="VERIFY")
    threads: ThreadSettings = topic(env_role="VERIFY")
    parallel: ParallelSettings = topic()

    def check(self) -> None:
        parallel = self.parallel
        if parallel.rank >= parallel.world_size:
            raise SettingsError(f"--rank {parallel.rank} is outside a world of size {parallel.world_size} "
                                f"(--world-size)")
        if not self.engine.batch_invariant:  # else the device's own refusal says more (at start-up)
            _cuda_rules(self.model, self.engine, parallel.world_size)
        elif parallel.world_size > 1:
            raise SettingsError("--batch-invariant needs --tp 1 (an all-reduce's order depends on the message size)")
        _placement_rule(self.speculation, self.parallel.world_size)
        _stall_rule(self.engine, max(self.speculation.draft_timeout, self.parallel.collective_timeout))

    @property
    def drafting(self) -> bool:
        return bool(self.model.draft) and not self.model.no_draft


@frozen
class DraftCommand:
    """dflash-draft-worker."""
    model: ModelSettings = topic(only=("target", "draft", "device", "dtype", "block_size", "max_model_len"))
    speculation: SpeculationSettings = topic(only=("draft_sampling",))
    worker: DraftWorkerSettings = topic()
    transport: TransportSettings = topic()
    channels: ChannelSettings = topic(only=("draft_addr",))
    metrics: MetricsSettings = topic(env_role="DRAFT", defaults={"metrics_port": 9102})
    threads: ThreadSettings = topic(env_role="DRAFT")


@frozen
class GatewayCommand:
    """dflash-gateway."""
    model: ModelSettings = topic(only=("target", "draft", "no_draft", "max_model_len"))
    http: HttpSettings = topic()
    channels: ChannelSettings = topic(only=("requests_addr", "events_addr"))


@frozen
class ServeCommand:
    """dflash-serve: every process's settings, from which it builds each child's."""
    model: ModelSettings = topic()
    engine: EngineSettings = topic()
    speculation: SpeculationSettings = topic(only=("spec_policy", "draft_placement", "draft_sampling", "grammar_drafts",
                                                   "draft_timeout"))
    transport: TransportSettings = topic(only=("feature_transport",))
    http: HttpSettings = topic(only=("host", "port", "served_model_name", "api_key", "default_max_tokens",
                                     "max_body_mb", "tool_call_parser", "reasoning_parser",
                                     "shutdown_timeout"))
    parallel: ParallelSettings = topic(only=("world_size", "collective_timeout"))
    metrics: MetricsSettings = topic(only=("metrics_host",))
    verify_threads: ThreadSettings = topic(prefix="verify-", env_role="VERIFY")
    draft_threads: ThreadSettings = topic(prefix="draft-", env_role="DRAFT")
    serve: ServeSettings = topic()

    def check(self) -> None:
        _cuda_rules(self.model, self.engine, self.parallel.world_size)
        _placement_rule(self.speculation, self.parallel.world_size)
        _stall_rule(self.engine, max(self.speculation.draft_timeout, self.parallel.collective_timeout))


@frozen
class GenerateCommand:
    """dflash-generate's model and compute settings (its prompt and sampling flags are its own)."""
    model: ModelSettings = topic(only=("target", "draft", "device", "dtype", "block_size"))
    engine: EngineSettings = topic(only=("batch_invariant",))
    speculation: SpeculationSettings = topic(only=("draft_sampling",))
    threads: ThreadSettings = topic(only=("threads",))
