"""Hardware and model presets, and `SimSettings`, the simulator's one configuration object.

Presets are plain frozen dataclasses; `SimSettings` (pydantic-settings, `PHASEWATCH_SIM_*`)
picks a preset by name and lets every number be overridden. `resolve()` turns settings into
the concrete, validated figures the engine runs with, or raises `SimConfigError` with a
sentence that says which setting is wrong and why. Nothing here touches a clock or a socket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from phasewatch.core.settings import LogLevel, describe
from phasewatch.sim.costmodel import CostModel, Hardware, ModelShape
from phasewatch.sim.scheduler import Scheduler, SchedulerConfig

ENV_PREFIX = "PHASEWATCH_SIM_"
GiB = 1024**3


class SimConfigError(ValueError):
    """Raised when the simulator's configuration is invalid; its message is meant for a human."""


@dataclass(frozen=True, slots=True)
class GpuPreset:
    """Datasheet figures for one GPU SKU, plus the efficiencies we assume on it.

    `peak_tflops` is dense (no 2:4 sparsity) FP16/BF16 tensor-core throughput. `mfu` and `mbu`
    are the fractions of peak FLOPs and of peak bandwidth a real serving step reaches.
    `step_overhead_ms` is the fixed cost of one engine step (scheduling, kernel launches,
    sampling); `request_overhead_ms` is the frontend path paid once per request before it
    reaches the scheduler (HTTP parse, tokenization, IPC to the engine core).
    """

    name: str
    description: str
    peak_tflops: float
    mem_bandwidth_gbs: float
    memory_gib: float
    mfu: float
    mbu: float
    step_overhead_ms: float
    request_overhead_ms: float


@dataclass(frozen=True, slots=True)
class ModelPreset:
    name: str
    hf_name: str
    n_params: float
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int


GPU_PRESETS: dict[str, GpuPreset] = {
    # T4 efficiencies are calibrated so Qwen2.5-0.5B lands on the article's indicative table
    # (TTFT 41/58/119/372 ms at 64/256/1024/4096 prompt tokens, ITL ~9.8 ms); see
    # docs/simulator.md. A Colab-class host makes the frontend and per-step costs large.
    "t4": GpuPreset(
        "t4",
        "NVIDIA T4 16 GB (PCIe, 70 W)",
        65.0,
        320.0,
        15.0,
        mfu=0.22,
        mbu=0.60,
        step_overhead_ms=4.5,
        request_overhead_ms=32.0,
    ),
    "a100": GpuPreset(
        "a100",
        "NVIDIA A100 80 GB SXM4",
        312.0,
        2039.0,
        80.0,
        mfu=0.45,
        mbu=0.75,
        step_overhead_ms=2.0,
        request_overhead_ms=10.0,
    ),
    "h100": GpuPreset(
        "h100",
        "NVIDIA H100 80 GB SXM5",
        989.0,
        3350.0,
        80.0,
        mfu=0.40,
        mbu=0.75,
        step_overhead_ms=2.0,
        request_overhead_ms=10.0,
    ),
    "h200": GpuPreset(
        "h200",
        "NVIDIA H200 141 GB SXM",
        989.0,
        4800.0,
        140.0,
        mfu=0.40,
        mbu=0.75,
        step_overhead_ms=2.0,
        request_overhead_ms=10.0,
    ),
}

MODEL_PRESETS: dict[str, ModelPreset] = {
    "qwen2.5-0.5b": ModelPreset(
        "qwen2.5-0.5b",
        "Qwen/Qwen2.5-0.5B-Instruct",
        0.494e9,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        head_dim=64,
        vocab_size=151936,
        max_position=32768,
    ),
    "llama-3.1-8b": ModelPreset(
        "llama-3.1-8b",
        "meta-llama/Llama-3.1-8B-Instruct",
        8.03e9,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position=131072,
    ),
}


class SimSettings(BaseSettings):
    """Everything the simulator can be told. `None` means "the preset's (or vLLM's) default"."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)

    gpu: str = "t4"
    model: str = "qwen2.5-0.5b"
    served_model_name: str | None = None

    # Hardware overrides.
    peak_tflops: float | None = Field(default=None, gt=0)
    mem_bandwidth_gbs: float | None = Field(default=None, gt=0)
    gpu_memory_gib: float | None = Field(default=None, gt=0)
    mfu: float | None = Field(default=None, gt=0, le=1)
    mbu: float | None = Field(default=None, gt=0, le=1)
    step_overhead_ms: float | None = Field(default=None, ge=0)
    request_overhead_ms: float | None = Field(default=None, ge=0)

    # Model-shape overrides.
    n_params: float | None = Field(default=None, gt=0)
    n_layers: int | None = Field(default=None, ge=1)
    n_heads: int | None = Field(default=None, ge=1)
    n_kv_heads: int | None = Field(default=None, ge=1)
    head_dim: int | None = Field(default=None, ge=1)

    # vLLM engine arguments, with vLLM's names.
    max_model_len: int | None = Field(default=None, ge=2)
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    enable_chunked_prefill: bool = True
    block_size: int = Field(default=16, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    # Size of the KV cache, as blocks or GiB; at most one of the two. Neither: sized like vLLM
    # from GPU memory minus weights minus an activation reserve.
    kv_cache_blocks: int | None = Field(default=None, ge=1)
    kv_cache_gib: float | None = Field(default=None, gt=0)
    activation_reserve_gib: float = Field(default=1.0, ge=0)

    # 10 means every modelled duration takes 10x wall time; metrics stay in model seconds.
    time_scale: float = Field(default=1.0, gt=0)
    # Output text and EOS draws are seeded; a request's own `seed` wins.
    seed: int = 0
    # Chance per generated token of drawing EOS when a request does not set ignore_eos.
    # 0 (the default) always generates max_tokens, which is what benchmarks want.
    eos_probability: float = Field(default=0.0, ge=0, lt=1)
    # A fault applied to every request (same syntax as the x-sim-fault header).
    fault: str | None = None
    # Finished requests whose token timeline is kept for GET /sim/requests/{id}.
    timeline_capacity: int = Field(default=4096, ge=1)

    log_level: LogLevel = "info"

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str) -> str:
        if value.lower() not in GPU_PRESETS:
            raise ValueError(f"must be one of {', '.join(GPU_PRESETS)}")
        return value.lower()

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        if value.lower() not in MODEL_PRESETS:
            raise ValueError(f"must be one of {', '.join(MODEL_PRESETS)}")
        return value.lower()

    @field_validator("fault")
    @classmethod
    def _valid_fault(cls, value: str | None) -> str | None:
        if value:
            from phasewatch.sim.faults import FaultSyntaxError, parse_fault

            try:
                parse_fault(value)
            except FaultSyntaxError as exc:
                raise ValueError(str(exc)) from None
        return value or None


def load_sim_settings(**overrides: Any) -> SimSettings:
    """Build SimSettings from the environment and overrides, or raise SimConfigError saying why."""
    try:
        return SimSettings(**overrides)
    except ValidationError as exc:
        raise SimConfigError(describe(exc, ENV_PREFIX)) from None


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """The concrete figures one simulator instance runs with, after presets and overrides."""

    gpu: GpuPreset
    model: ModelPreset
    served_model_name: str
    hardware: Hardware
    shape: ModelShape
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    block_size: int
    num_kv_blocks: int
    request_overhead_s: float
    time_scale: float
    vocab_size: int

    @property
    def cost_model(self) -> CostModel:
        return CostModel(self.hardware, self.shape)

    def summary(self) -> dict[str, Any]:
        """What `/version` and the startup line report about this instance."""
        cost = self.cost_model
        return {
            "gpu": self.gpu.description,
            "model": self.model.hf_name,
            "served_model_name": self.served_model_name,
            "peak_tflops": self.hardware.peak_flops / 1e12,
            "mem_bandwidth_gbs": self.hardware.mem_bandwidth / 1e9,
            "mfu": self.hardware.mfu,
            "mbu": self.hardware.mbu,
            "step_overhead_ms": self.hardware.step_overhead_s * 1e3,
            "request_overhead_ms": self.request_overhead_s * 1e3,
            "effective_ridge_flops_per_byte": round(cost.effective_ridge_point, 1),
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_chunked_prefill": self.enable_chunked_prefill,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "time_scale": self.time_scale,
            "clock": "model seconds; every modelled duration takes time_scale x wall time",
        }


def resolve(settings: SimSettings) -> ResolvedConfig:
    """Apply overrides to the presets and check the result can serve a request at all."""
    gpu = GPU_PRESETS[settings.gpu]
    model = MODEL_PRESETS[settings.model]

    def pick(value: float | None, default: float) -> float:
        return default if value is None else value

    hardware = Hardware(
        peak_flops=pick(settings.peak_tflops, gpu.peak_tflops) * 1e12,
        mem_bandwidth=pick(settings.mem_bandwidth_gbs, gpu.mem_bandwidth_gbs) * 1e9,
        mfu=pick(settings.mfu, gpu.mfu),
        mbu=pick(settings.mbu, gpu.mbu),
        step_overhead_s=pick(settings.step_overhead_ms, gpu.step_overhead_ms) / 1e3,
    )
    shape = ModelShape(
        n_params=pick(settings.n_params, model.n_params),
        n_layers=settings.n_layers or model.n_layers,
        n_heads=settings.n_heads or model.n_heads,
        n_kv_heads=settings.n_kv_heads or model.n_kv_heads,
        head_dim=settings.head_dim or model.head_dim,
    )
    memory_gib = pick(settings.gpu_memory_gib, gpu.memory_gib)
    max_model_len = settings.max_model_len or model.max_position

    # vLLM V1's defaults for the OpenAI server depend on GPU memory: 70 GiB and up (H100-class)
    # gets 8192 batched tokens and 1024 sequences, smaller GPUs 2048 and 256.
    big_gpu = memory_gib >= 70
    max_num_seqs = settings.max_num_seqs or (1024 if big_gpu else 256)
    max_num_batched_tokens = settings.max_num_batched_tokens or (8192 if big_gpu else 2048)
    if not settings.enable_chunked_prefill:
        # Without chunked prefill vLLM must fit a whole prompt in one step.
        max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
    if max_num_batched_tokens < max_num_seqs:
        raise SimConfigError(
            f"{ENV_PREFIX}MAX_NUM_BATCHED_TOKENS={max_num_batched_tokens} is smaller than "
            f"{ENV_PREFIX}MAX_NUM_SEQS={max_num_seqs}: every running sequence needs a token "
            "of budget per step"
        )

    block_bytes = settings.block_size * shape.kv_bytes_per_token
    if settings.kv_cache_blocks is not None and settings.kv_cache_gib is not None:
        raise SimConfigError(
            f"set at most one of {ENV_PREFIX}KV_CACHE_BLOCKS and {ENV_PREFIX}KV_CACHE_GIB"
        )
    if settings.kv_cache_blocks is not None:
        num_blocks = settings.kv_cache_blocks
    else:
        if settings.kv_cache_gib is not None:
            kv_bytes = settings.kv_cache_gib * GiB
        else:
            kv_bytes = (
                memory_gib * settings.gpu_memory_utilization - settings.activation_reserve_gib
            ) * GiB - shape.weight_bytes
            if kv_bytes <= 0:
                raise SimConfigError(
                    f"{model.hf_name} weights ({shape.weight_bytes / GiB:.1f} GiB) leave no room "
                    f"for a KV cache on {gpu.description} ({memory_gib:.0f} GiB x "
                    f"{settings.gpu_memory_utilization} utilization); pick a bigger "
                    f"{ENV_PREFIX}GPU or set {ENV_PREFIX}KV_CACHE_GIB"
                )
        num_blocks = int(kv_bytes // block_bytes)
    needed = math.ceil(max_model_len / settings.block_size)
    if num_blocks < needed:
        raise SimConfigError(
            f"the KV cache ({num_blocks} blocks of {settings.block_size} tokens) cannot hold one "
            f"sequence of max_model_len={max_model_len} tokens ({needed} blocks); lower "
            f"{ENV_PREFIX}MAX_MODEL_LEN or enlarge the KV cache"
        )

    return ResolvedConfig(
        gpu=gpu,
        model=model,
        served_model_name=settings.served_model_name or model.hf_name,
        hardware=hardware,
        shape=shape,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=settings.enable_chunked_prefill,
        block_size=settings.block_size,
        num_kv_blocks=num_blocks,
        request_overhead_s=pick(settings.request_overhead_ms, gpu.request_overhead_ms) / 1e3,
        time_scale=settings.time_scale,
        vocab_size=model.vocab_size,
    )


def scheduler_config(config: ResolvedConfig) -> SchedulerConfig:
    """The scheduler's limits under this configuration."""
    return SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_chunked_prefill=config.enable_chunked_prefill,
        num_kv_blocks=config.num_kv_blocks,
        block_size=config.block_size,
    )


def scheduler_for(config: ResolvedConfig) -> Scheduler:
    """A fresh scheduler with this configuration's limits and cost model."""
    return Scheduler(scheduler_config(config), config.cost_model)


def with_chunked_prefill(settings: SimSettings, enabled: bool) -> SimSettings:
    """The same settings with chunked prefill switched; `resolve` then gives the budget vLLM
    would run with (the one configured or the preset's on, at least max_model_len off)."""
    return settings.model_copy(update={"enable_chunked_prefill": enabled})
