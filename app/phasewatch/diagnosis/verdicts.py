"""The nine verdicts, what each means, and what to do about it.

Actions come from the article's "Dial it in" table and its production advice (seed article,
"Prefill vs Decode"): the knob, which way to move it, and why. A verdict's value is also its
Prometheus label value (`phasewatch_diagnosis_verdict{verdict=...}`): never rename one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Verdict(StrEnum):
    HEALTHY = "healthy"
    QUEUEING = "queueing"
    DECODE_SATURATION = "decode_saturation"
    OUT_OF_CAPACITY = "out_of_capacity"
    PREFILL_BOUND = "prefill_bound"
    INTERFERENCE = "interference"
    KV_PRESSURE = "kv_pressure"
    UNEXPLAINED = "unexplained"
    INSUFFICIENT_DATA = "insufficient_data"


MEANING: dict[Verdict, str] = {
    Verdict.HEALTHY: "TTFT and ITL are where the baseline had them.",
    Verdict.QUEUEING: "TTFT rose at equal prompt length while ITL held: requests wait for a "
    "scheduler slot before prefill starts.",
    Verdict.DECODE_SATURATION: "ITL rose with the decode batch while TTFT held: the server is "
    "near its throughput/latency boundary.",
    Verdict.OUT_OF_CAPACITY: "TTFT (queueing) and ITL (decode batch) both rose: the server is "
    "out of capacity.",
    Verdict.PREFILL_BOUND: "TTFT rose with prompt length, not load: prefill work grew.",
    Verdict.INTERFERENCE: "Streams stall mid-output while long prompts prefill: long prefills "
    "hold up everyone's decode steps.",
    Verdict.KV_PRESSURE: "The engine's KV cache is near full and it preempts sequences.",
    Verdict.UNEXPLAINED: "TTFT or ITL misses its SLO (or rose where it matters) and the "
    "evidence names none of the known causes; what it ruled out is in the evidence.",
    Verdict.INSUFFICIENT_DATA: "Too few requests to tell a change from noise.",
}


@dataclass(frozen=True, slots=True)
class Action:
    knob: str
    change: str
    why: str

    def as_dict(self) -> dict[str, str]:
        return {"knob": self.knob, "change": self.change, "why": self.why}


_SCALE_OUT = Action(
    "replicas", "scale out (or admit less)",
    "TTFT absorbs queueing, which grows non-linearly as arrivals approach the service rate; "
    "it is a signal to scale out rather than to tune",
)
_CAP_SEQS = Action(
    "--max-num-seqs", "lower it (cap concurrency)",
    "it caps the decode batch: lower it to protect ITL under load; find where ITL crosses "
    "your target as concurrency rises and set the cap below it",
)

ACTIONS: dict[Verdict, tuple[Action, ...]] = {
    Verdict.HEALTHY: (),
    Verdict.QUEUEING: (
        _SCALE_OUT,
        Action("--max-num-seqs", "raise it only if the KV cache allows and ITL has headroom",
               "more slots drain the queue but grow the decode batch, and so ITL"),
    ),
    Verdict.DECODE_SATURATION: (
        _CAP_SEQS,
        Action("replicas", "scale out for the capacity the cap gives up",
               "throughput is then whatever the capped batch yields"),
        Action("model / GPU choice", "more memory bandwidth",
               "decode is bandwidth-bound: bandwidth improves ITL, FLOPs barely move it"),
    ),
    Verdict.OUT_OF_CAPACITY: (
        _SCALE_OUT,
        _CAP_SEQS,
    ),
    Verdict.PREFILL_BOUND: (
        Action("prompts", "shorten them",
               "TTFT tracks prompt length: prefill work scales with it"),
        Action("prefix caching", "turn it on if prompts share prefixes",
               "a cached prefix is not prefilled again"),
        Action("model / GPU choice", "more compute (FLOPs)",
               "prefill is compute-bound: prefill-heavy traffic wants FLOPs"),
        Action("--max-num-batched-tokens", "raise it for prefill-heavy batch work",
               "larger steps prefill more efficiently, at some cost to everyone's ITL"),
        Action("--max-model-len", "bound it at your measured p99 prompt",
               "it bounds the largest prefill you can be asked to do"),
    ),
    Verdict.INTERFERENCE: (
        Action("--enable-chunked-prefill", "make sure it is on",
               "long prefills then interleave with decode instead of blocking it; turning it "
               "off is almost always wrong for interactive serving"),
        Action("--max-num-batched-tokens", "lower it",
               "ITL is spiky under long prompts: smaller steps mean smoother ITL for everyone, "
               "at a slightly worse TTFT for the long prompt itself"),
    ),
    Verdict.KV_PRESSURE: (
        Action("--max-num-seqs", "lower it",
               "raising it only helps if the KV cache allows: fewer sequences need fewer blocks "
               "and are not preempted"),
        Action("--max-model-len", "bound it at your measured p99",
               "it caps the KV cache each sequence can claim"),
        Action("KV cache size", "give it more memory (--gpu-memory-utilization, a larger GPU)",
               "preempted sequences are recomputed from scratch: wasted prefill and stalls"),
    ),
    Verdict.UNEXPLAINED: (
        Action("baseline", "compare with a known-good run (baseline=run:<id>) or span",
               "a change against healthy traffic names a cause that one window alone cannot"),
        Action("engine metrics", "scrape them if they are not (PHASEWATCH_ENGINE_METRICS_ENABLED)",
               "the engine's waiting count, batch and queue time tell a queue from slow steps"),
        Action("the path in front of the engine", "look at the API server, network and proxy",
               "time spent before the engine's queue shows in TTFT and nowhere in the engine"),
    ),
    Verdict.INSUFFICIENT_DATA: (
        Action("window", "widen it or wait for traffic",
               "below the minimum sample size a change cannot be told from noise"),
    ),
}
