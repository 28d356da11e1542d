"""The roofline cost of one engine step: pure arithmetic, no clock, no I/O.

A step runs some sequences' new tokens through the model at once (prefill chunks and one-token
decodes together, as vLLM's v1 engine does). Its time is

    max(FLOPs / (peak FLOP/s x MFU), bytes / (peak bandwidth x MBU)) + fixed step overhead

FLOPs: 2 x params per new token (the matmuls) plus attention, 4 x n_heads x head_dim x layers
per (query, key) pair; a query at position i attends to i keys (causal).
Bytes: the weights once per step, plus the KV cache each sequence reads (its context) and
writes (its new tokens). Activations, the sampler and communication are left out.

So a prefill is compute-bound and grows with prompt length, a decode batch is bandwidth-bound
and flat in batch size until the batch reaches the effective ridge point, and one long prefill
in a step makes every decode in that step wait for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Hardware:
    peak_flops: float  # dense FP16/BF16 FLOP/s
    mem_bandwidth: float  # bytes/s
    mfu: float  # fraction of peak_flops a step reaches
    mbu: float  # fraction of mem_bandwidth a step reaches
    step_overhead_s: float  # per-step fixed cost: scheduling, launches, sampling


@dataclass(frozen=True, slots=True)
class ModelShape:
    n_params: float
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    bytes_per_param: float = 2.0  # BF16 weights
    kv_bytes_per_elem: float = 2.0  # BF16 KV cache

    @property
    def weight_bytes(self) -> float:
        return self.n_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, per layer, per KV head.
        return int(2 * self.n_layers * self.n_kv_heads * self.head_dim * self.kv_bytes_per_elem)

    @property
    def attn_flops_per_pair(self) -> float:
        # QK^T and AV: 2 matmuls x 2 FLOPs per multiply-add, over all query heads and layers.
        return 4.0 * self.n_heads * self.head_dim * self.n_layers


@dataclass(frozen=True, slots=True)
class Work:
    """One sequence's share of a step: `num_new` tokens on top of `num_computed` cached ones."""

    num_new: int
    num_computed: int


@dataclass(frozen=True, slots=True)
class StepCost:
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    overhead_s: float

    @property
    def duration_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


class StepCoster(Protocol):
    """What the scheduler asks of a cost model: the cost of one step's work."""

    def step_cost(self, works: Iterable[Work]) -> StepCost: ...


class CostModel:
    """Turns a step's work into its duration on one GPU for one model."""

    def __init__(self, hardware: Hardware, shape: ModelShape) -> None:
        self.hardware = hardware
        self.shape = shape
        self._flops_per_s = hardware.peak_flops * hardware.mfu
        self._bytes_per_s = hardware.mem_bandwidth * hardware.mbu
        self._linear_flops = 2.0 * shape.n_params
        self._pair_flops = shape.attn_flops_per_pair
        self._kv_bytes = shape.kv_bytes_per_token

    @property
    def effective_ridge_point(self) -> float:
        """FLOPs per byte above which a step is compute-bound, at the assumed MFU and MBU."""
        return self._flops_per_s / self._bytes_per_s

    @property
    def peak_ridge_point(self) -> float:
        """The datasheet ridge point (peak FLOP/s / peak bandwidth), as the article quotes it."""
        return self.hardware.peak_flops / self.hardware.mem_bandwidth

    def step_cost(self, works: Iterable[Work]) -> StepCost:
        tokens = 0
        pairs = 0.0
        kv_tokens = 0
        for work in works:
            q, s = work.num_new, work.num_computed
            tokens += q
            # Queries at positions s+1 .. s+q each attend to that many keys.
            pairs += q * s + q * (q + 1) / 2
            # Read the cached context once, write the new tokens' K and V.
            kv_tokens += s + q
        if tokens == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
        flops = self._linear_flops * tokens + self._pair_flops * pairs
        moved = self.shape.weight_bytes + float(self._kv_bytes * kv_tokens)
        return StepCost(
            flops=flops,
            bytes=moved,
            compute_s=flops / self._flops_per_s,
            memory_s=moved / self._bytes_per_s,
            overhead_s=self.hardware.step_overhead_s,
        )

    def prefill_s(self, prompt_tokens: int) -> float:
        """One whole prefill alone in a step (what TTFT is on an idle engine, less frontend)."""
        return self.step_cost([Work(prompt_tokens, 0)]).duration_s

    def decode_step_s(self, batch: int, context: int) -> float:
        """One decode step for `batch` sequences that each hold `context` cached tokens."""
        return self.step_cost([Work(1, context)] * batch).duration_s
