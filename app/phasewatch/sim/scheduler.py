"""A pure model of vLLM's v1 scheduler: continuous batching over a paged KV cache.

`Scheduler.step()` plans one engine step and applies its outcome to the scheduler's state:

- running sequences first, in order: a decode needs 1 token of budget, an unfinished prefill
  takes what is left of `max_num_batched_tokens` (chunked prefill) or must fit whole;
- a running sequence that cannot get the KV block it needs preempts the newest running
  sequence (recompute: its blocks are freed, it goes back to the front of the waiting queue
  and will prefill its prompt and the tokens it already produced again), as v1 does;
- then, if nothing was preempted, waiting sequences join in FIFO order while there is a slot
  (`max_num_seqs`), token budget and KV blocks for them.

A sequence whose KV reaches all its known tokens at the end of the step samples one output
token. The step's duration comes from the cost model. There is no clock and no I/O here: the
async driver (`engine.py`) decides when steps happen and when their tokens are delivered.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from phasewatch.sim.costmodel import StepCost, StepCoster, Work


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    num_kv_blocks: int
    block_size: int = 16


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_len: int
    max_output: int  # output tokens to produce before finishing (max_tokens, or the drawn EOS)
    num_output: int = 0
    num_computed: int = 0  # tokens whose K and V are in the cache
    num_blocks: int = 0
    num_preemptions: int = 0
    scheduled_once: bool = False

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output


@dataclass(frozen=True, slots=True)
class ScheduledWork:
    request_id: str
    num_new: int
    num_computed: int  # before this step
    is_prefill: bool  # more than the one token a decode computes was outstanding


@dataclass(frozen=True, slots=True)
class TokenOut:
    request_id: str
    index: int  # 0-based position among the request's output tokens
    finished: bool


@dataclass(frozen=True, slots=True)
class Step:
    work: tuple[ScheduledWork, ...]
    cost: StepCost
    tokens: tuple[TokenOut, ...]
    first_scheduled: tuple[str, ...]  # requests that left the waiting queue for the first time
    preempted: tuple[str, ...]
    num_running: int  # after the step
    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use after the step, 0-1

    @property
    def duration_s(self) -> float:
        return self.cost.duration_s

    @property
    def num_prefill_tokens(self) -> int:
        return sum(w.num_new for w in self.work if w.is_prefill)

    @property
    def num_decodes(self) -> int:
        return sum(1 for w in self.work if not w.is_prefill)


@dataclass(slots=True)
class _Plan:
    work: list[tuple[Sequence, int]] = field(default_factory=list)
    first: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cost_model: StepCoster) -> None:
        self.config = config
        self.cost_model = cost_model
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self.free_blocks = config.num_kv_blocks
        self.num_preemptions = 0

    # -- requests in and out -------------------------------------------------------------------

    def add(self, request_id: str, prompt_len: int, max_output: int) -> None:
        if request_id in self._by_id:
            raise ValueError(f"request {request_id} is already scheduled")
        if prompt_len < 1 or max_output < 1:
            raise ValueError("a request needs at least one prompt token and one output token")
        seq = Sequence(request_id, prompt_len, max_output)
        self._by_id[request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks; False if it was not here."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._free(seq)
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def sequence(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.config.num_kv_blocks

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> Step | None:
        """Plan one step, apply its outcome, and return it; None when there is nothing to run."""
        plan = self._plan()
        if not plan.work:
            return None
        works: list[ScheduledWork] = []
        tokens: list[TokenOut] = []
        for seq, num_new in plan.work:
            outstanding = seq.num_tokens - seq.num_computed
            works.append(ScheduledWork(seq.request_id, num_new, seq.num_computed, outstanding > 1))
            seq.num_computed += num_new
            if seq.num_computed < seq.num_tokens:
                continue  # a prefill chunk that does not finish the prompt samples nothing
            index = seq.num_output
            seq.num_output += 1
            finished = seq.num_output >= seq.max_output
            tokens.append(TokenOut(seq.request_id, index, finished))
            if finished:
                self.running.remove(seq)
                del self._by_id[seq.request_id]
                self._free(seq)
        cost = self.cost_model.step_cost(Work(w.num_new, w.num_computed) for w in works)
        return Step(
            work=tuple(works),
            cost=cost,
            tokens=tuple(tokens),
            first_scheduled=tuple(plan.first),
            preempted=tuple(plan.preempted),
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv_usage,
        )

    def _plan(self) -> _Plan:
        plan = _Plan()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = seq.num_tokens - seq.num_computed
            if num_new > budget:
                if not chunked:
                    index += 1  # a whole prefill that does not fit waits for a later step
                    continue
                num_new = budget
            scheduled = True
            while not self._allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim.request_id)
                plan.work = [(s, n) for s, n in plan.work if s is not victim]
                if victim is seq:
                    scheduled = False
                    break
            if not scheduled:
                break
            plan.work.append((seq, num_new))
            budget -= num_new
            index += 1

        if plan.preempted:
            return plan  # as in v1: no admissions in a step that had to preempt

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = seq.num_tokens - seq.num_computed
            if num_new > budget:
                if not chunked:
                    break
                num_new = budget
            if not self._allocate(seq, num_new):
                break
            self.waiting.popleft()
            self.running.append(seq)
            if not seq.scheduled_once:
                seq.scheduled_once = True
                plan.first.append(seq.request_id)
            plan.work.append((seq, num_new))
            budget -= num_new
        return plan

    # -- KV blocks ----------------------------------------------------------------------------

    def _allocate(self, seq: Sequence, num_new: int) -> bool:
        """Give `seq` the blocks it needs to hold `num_new` more tokens, if there are enough."""
        size = self.config.block_size
        needed = -(-(seq.num_computed + num_new) // size) - seq.num_blocks
        if needed <= 0:
            return True
        if needed > self.free_blocks:
            return False
        self.free_blocks -= needed
        seq.num_blocks += needed
        return True

    def _free(self, seq: Sequence) -> None:
        self.free_blocks += seq.num_blocks
        seq.num_blocks = 0

    def _preempt(self, seq: Sequence) -> None:
        # Recompute preemption: forget the cache, keep the output produced so far.
        self._free(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
