"""Pure pieces of the hot path: event classification, usage stripping, timing arithmetic."""

from __future__ import annotations

import random
from array import array
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from phasewatch.core.events import (
    MAX_TOKEN_COUNT,
    Kind,
    add_fingerprint,
    classify,
    strip_usage,
    system_fingerprint,
    token_count,
)
from phasewatch.core.log_throttle import LogThrottle
from phasewatch.core.metrics import ProxyMetrics
from phasewatch.core.quantiles import percentile
from phasewatch.core.records import Outcome, RequestRecord
from phasewatch.proxy import _native, gap_summary
from phasewatch.proxy import timing as timing_module
from phasewatch.proxy.gap_summary import GapSummary
from phasewatch.proxy.labels import _CONTROL, model_name
from phasewatch.proxy.request_plan import plan_request
from phasewatch.proxy.stream import StreamFeed
from phasewatch.proxy.timing import NS, PENDING_LIMIT, Exemplar, StreamTiming, figures
from tests.support import itl_oracle

MS = 1_000_000


class Observed(list[float]):
    """A histogram's `observe(value, exemplar)` for the tests: the values, in order, and the
    (value, exemplar) pairs that came with an exemplar."""

    def __init__(self) -> None:
        super().__init__()
        self.exemplars: list[tuple[float, Exemplar]] = []

    def observe(self, value: float, exemplar: Exemplar | None = None) -> None:
        self.append(value)
        if exemplar is not None:
            self.exemplars.append((value, exemplar))


@pytest.mark.parametrize(
    ("data", "kind", "chars"),
    [
        (b"[DONE]", Kind.DONE, 0),
        (b'{"choices":[{"index":0,"text":"Hi"}]}', Kind.OUTPUT, 2),
        (b'{"choices":[{"index":0,"text":""}]}', Kind.EMPTY, 0),
        (b'{"choices":[{"delta":{"role":"assistant","content":""}}]}', Kind.EMPTY, 0),
        (b'{"choices":[{"delta":{"content":"abc"}}]}', Kind.OUTPUT, 3),
        (b'{"choices":[{"delta":{"reasoning_content":"hm"}}]}', Kind.OUTPUT, 2),
        (b'{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]}',
         Kind.OUTPUT, None),
        (b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9}}', Kind.USAGE, 0),
        (b'{"error":{"message":"boom","code":500}}', Kind.ERROR, 0),
        (b"not json", Kind.OTHER, 0),
        (b"[1,2]", Kind.OTHER, 0),
    ],
)
def test_classify(data: bytes, kind: Kind, chars: int | None) -> None:
    info = classify(data)
    assert info.kind is kind
    if chars is not None:
        assert info.chars == chars
    else:
        assert info.chars > 0


def test_classify_reads_running_usage() -> None:
    info = classify(b'{"choices":[{"text":"x"}],"usage":{"prompt_tokens":5,"completion_tokens":4}}')
    assert (info.kind, info.completion_tokens, info.prompt_tokens) == (Kind.OUTPUT, 4, 5)


CHUNK = (b'data: {"id":"c","choices":[{"index":0,"text":"hi \\"usage\\":{"}],'
         b'"usage":{"prompt_tokens":5,"total_tokens":7,"completion_tokens":2,'
         b'"prompt_tokens_details":{"cached_tokens":0}}}\n\n')


def test_strip_usage_cuts_only_the_usage_object() -> None:
    # vLLM 0.32 writes chunks with set fields only: without usage asked for, no `usage` key.
    stripped = strip_usage(CHUNK)
    assert stripped == b'data: {"id":"c","choices":[{"index":0,"text":"hi \\"usage\\":{"}]}\n\n'
    assert orjson.loads(stripped[6:])["choices"][0]["text"] == 'hi "usage":{'


def test_strip_usage_leaves_null_usage_and_handles_spaced_json() -> None:
    null = b'data: {"choices":[],"usage":null}\n\n'
    assert strip_usage(null) is null
    spaced = b'data: {"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}}\n\n'
    assert orjson.loads(strip_usage(spaced)[6:]) == {"choices": [{"text": "a"}]}


@pytest.mark.parametrize(
    ("data", "finished"),
    [
        (b'{"choices":[{"index":0,"text":"a","finish_reason":null}]}', False),
        (b'{"choices":[{"index":0,"text":"a","finish_reason":"length"}]}', True),
        (b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop","stop_reason":null}]}', True),
        (b'{"choices":[{"index":0,"text":"finish_reason\\":\\"stop"}]}', False),
        (b'{"choices":[{"index":0,"delta":{"content":"a"}}],"usage":{"completion_tokens":1}}',
         False),
        (b'{"choices":[],"usage":{"completion_tokens":1},"system_fingerprint":"f"}', False),
        (b"[DONE]", False),
    ],
)
def test_classify_says_which_events_finish_a_choice(data: bytes, finished: bool) -> None:
    assert classify(data).finished is finished


def test_system_fingerprint_is_read_byte_for_byte() -> None:
    usage_chunk = (b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":1,"total_tokens":3,'
                   b'"completion_tokens":2},"system_fingerprint":"vllm-0.32.0-1a2b3c4d"}\n\n')
    assert system_fingerprint(usage_chunk) == b'"vllm-0.32.0-1a2b3c4d"'
    escaped = b'data: {"choices":[],"system_fingerprint":"a\\"b\\\\","metrics":{}}\n\n'
    assert system_fingerprint(escaped) == b'"a\\"b\\\\"'
    assert orjson.loads(system_fingerprint(escaped) or b"") == 'a"b\\'
    for none in (b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\n',
                 b'data: {"choices":[],"system_fingerprint":null}\n\n',
                 b'data: {"choices":[{"text":"\\"system_fingerprint\\":\\"x\\""}]}\n\n'):
        assert system_fingerprint(none) is None


# vLLM 0.32's terminal completion chunk as phasewatch gets it (continuous usage, asked for by
# the proxy) and as the client would have got it (no usage asked for), in vLLM's field order.
VLLM_TERMINAL = (b'data: {"id":"cmpl-8f","object":"text_completion","created":1,"model":"m",'
                 b'"choices":[{"index":0,"text":" x","logprobs":null,"finish_reason":"length",'
                 b'"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]')
WITH_USAGE = VLLM_TERMINAL + (b',"usage":{"prompt_tokens":3,"total_tokens":8,'
                              b'"completion_tokens":5}}\n\n')
WITHOUT_USAGE = VLLM_TERMINAL + b',"system_fingerprint":"vllm-0.32.0-1a2b3c4d"}\n\n'


def test_add_fingerprint_writes_the_chunk_vllm_would_have_sent() -> None:
    fingerprint = b'"vllm-0.32.0-1a2b3c4d"'
    assert add_fingerprint(strip_usage(WITH_USAGE), fingerprint) == WITHOUT_USAGE
    assert add_fingerprint(WITHOUT_USAGE, b'"other"') is WITHOUT_USAGE  # already stamped


def test_timing_with_exact_running_usage_observes_as_tokens_arrive() -> None:
    ttfts = Observed()
    itl = Observed()
    t = StreamTiming(arrival_ns=0, observe_ttft=ttfts.observe, observe_itl=itl.observe)
    t.event(100 * MS, cumulative=1, chars=3)  # first token at 100 ms
    assert ttfts == [pytest.approx(0.1)] and itl == []  # TTFT observed when it happens
    t.event(120 * MS, cumulative=2, chars=3)  # one token after 20 ms
    assert itl == [pytest.approx(0.02)]
    t.event(180 * MS, cumulative=5, chars=9)  # three tokens in one chunk after 60 ms
    assert itl == pytest.approx([0.02, 0.02, 0.02, 0.02])
    t.completion_tokens, t.prompt_tokens, t.end_ns = 5, 11, 190 * MS
    t.settle()
    assert len(itl) == 4  # nothing more at the end
    f = figures(t)
    assert f.ttft_s == pytest.approx(0.1)
    assert f.itl == pytest.approx((4, 0.02, 0.02, 0.02, 0.02))
    assert f.tpot_s == pytest.approx((0.19 - 0.1) / 4)
    assert (f.output_tokens, f.prompt_tokens, f.tokens_exact) == (5, 11, True)
    assert sum(itl) == pytest.approx(0.08)  # the gaps add up to first -> last token


def test_first_token_is_the_first_count_above_zero_even_without_text() -> None:
    """vLLM can send a first chunk with empty text (a partial UTF-8 character) whose running
    usage already counts one token: that chunk is the first token, and a stream of n tokens
    has n - 1 gaps."""
    itl = Observed()
    t = StreamTiming(arrival_ns=0, observe_itl=itl.observe)
    t.event(10 * MS, cumulative=0, chars=0)  # nothing yet (not sent by the feed, but harmless)
    assert t.first_output_ns is None
    t.event(50 * MS, cumulative=1, chars=0)  # the partial character: token 1
    t.event(60 * MS, cumulative=2, chars=2)
    t.event(70 * MS, cumulative=3, chars=1)
    t.completion_tokens, t.end_ns = 3, 70 * MS
    t.settle()
    f = figures(t)
    assert f.ttft_s == pytest.approx(0.05)
    assert f.itl[0] == 2 == f.output_tokens - 1 and itl == pytest.approx([0.01, 0.01])


def test_feed_takes_an_empty_chunk_whose_count_rose_as_the_first_token() -> None:
    body = orjson.dumps({"model": "m", "stream": True})
    plan = plan_request(body, continuous_usage=True)
    record = RequestRecord(request_id="r", started_at=datetime.now(UTC), endpoint="completions",
                           model="m", upstream="u", stream=True, outcome=Outcome.OK,
                           http_status=200, in_flight_at_arrival=0, run_id=None)
    t = StreamTiming(arrival_ns=0)
    feed = StreamFeed(plan, record, t)

    def chunk(text: str, tokens: int) -> bytes:
        return b"data: " + orjson.dumps({
            "id": "c", "choices": [{"index": 0, "text": text, "finish_reason": None}],
            "usage": {"prompt_tokens": 4, "total_tokens": 4 + tokens,
                      "completion_tokens": tokens}}) + b"\n\n"

    out = feed.feed(chunk("", 1), 40 * MS)
    assert b"usage" not in out  # what the client did not ask for is still cut
    assert t.first_output_ns == 40 * MS
    feed.feed(chunk("\u00e9", 2), 55 * MS)
    assert t.gaps.count == 1 and t.tokens_seen == 2


def test_timing_estimates_tokens_from_characters_without_running_usage() -> None:
    itl = Observed()
    t = StreamTiming(arrival_ns=0, observe_itl=itl.observe)
    t.event(10 * MS, None, chars=4)
    t.event(40 * MS, None, chars=12)  # three times the text of its neighbours
    t.event(50 * MS, None, chars=4)
    assert itl == []  # the tokens behind each gap are known only from the final usage
    t.completion_tokens, t.end_ns = 5, 50 * MS
    t.settle()
    f = figures(t)
    assert not f.tokens_exact
    assert f.itl[0] == 4  # 5 tokens: 1 + 3 + 1, first one has no gap
    assert itl == pytest.approx([0.01, 0.01, 0.01, 0.01])


def test_running_usage_of_several_choices_is_not_taken_as_exact() -> None:
    """n=2: vLLM's running usage counts per choice, not per stream. Choice A's chunks carry
    1, 2 and 1 tokens, B's 1 each, interleaved: the running counts go 1, 1, 3, 2, 4, 3."""
    itl = Observed()
    t = StreamTiming(arrival_ns=0, single_choice=False, observe_itl=itl.observe)
    for i, (cumulative, chars) in enumerate(
        [(1, 2), (1, 2), (3, 4), (2, 2), (4, 2), (3, 2)], start=1
    ):
        t.event(i * 10 * MS, cumulative, chars)
    t.completion_tokens, t.end_ns = 7, 60 * MS  # the final usage sums both choices
    t.settle()
    f = figures(t)
    assert not f.tokens_exact  # estimated from the text, not misread from per-choice counts
    assert f.output_tokens == 7 and f.itl[0] == 6
    assert itl == pytest.approx([0.01, 0.005, 0.005, 0.01, 0.01, 0.01])


def test_plan_says_whether_the_request_asks_one_choice() -> None:
    assert plan_request(b'{"stream": true}', True).single_choice
    assert plan_request(b'{"stream": true, "n": 1}', True).single_choice
    assert not plan_request(b'{"stream": true, "n": 2}', True).single_choice


@pytest.mark.parametrize(("options", "continuous", "running"), [
    (None, True, True),  # phasewatch asks for it (the default)
    (None, False, False),  # PHASEWATCH_UPSTREAM_CONTINUOUS_USAGE off: final usage alone
    ({"include_usage": True}, False, False),
    ({"include_usage": True, "continuous_usage_stats": True}, False, True),  # the client asks
    ({"include_usage": True, "continuous_usage_stats": True}, True, True),
])
def test_plan_says_whether_every_chunk_will_carry_usage(
        options: dict[str, bool] | None, continuous: bool, running: bool) -> None:
    """What the native leg needs to take a stream from its head (relay.py)."""
    body: dict[str, object] = {"model": "m", "prompt": "hi", "stream": True}
    if options is not None:
        body["stream_options"] = options
    assert plan_request(orjson.dumps(body), continuous).running_usage is running
    assert not plan_request(orjson.dumps({**body, "stream": False}), True).running_usage


def test_timing_one_token_per_chunk_counts_as_exact_when_totals_agree() -> None:
    itl = Observed()
    t = StreamTiming(arrival_ns=0, observe_itl=itl.observe)
    for i in range(1, 4):
        t.event(i * 10 * MS, None, chars=2)
    t.completion_tokens, t.end_ns = 3, 30 * MS
    t.settle()
    f = figures(t)
    assert f.tokens_exact and itl == pytest.approx([0.01, 0.01])


def test_estimated_events_wait_in_bounded_memory() -> None:
    itl = Observed()
    t = StreamTiming(arrival_ns=0, observe_itl=itl.observe)
    events = PENDING_LIMIT + 101
    for i in range(1, events + 1):
        t.event(i * MS, None, chars=1)
    assert len(t.pending_gaps) == PENDING_LIMIT and len(itl) == 100  # the rest: one each, live
    t.completion_tokens = events
    t.settle()
    assert len(itl) == events - 1 and t.tokens_exact and not t.pending_gaps


def test_timing_without_output_has_no_ttft() -> None:
    t = StreamTiming(arrival_ns=0, end_ns=NS)
    t.settle()
    f = figures(t)
    assert (f.ttft_s, f.e2e_s, f.itl, f.tpot_s) == (None, 1.0, (0, None, None, None, None), None)


def test_exemplars_go_with_the_ttft_and_each_new_largest_gap_only() -> None:
    ttfts, itl = Observed(), Observed()
    ids = {"request_id": "r1"}
    t = StreamTiming(arrival_ns=0, observe_ttft=ttfts.observe, observe_itl=itl.observe,
                     exemplar=ids)
    t.event(100 * MS, cumulative=1, chars=1)
    for tokens, at_ms in ((2, 120), (3, 130), (4, 170), (5, 180), (7, 280), (8, 290)):
        t.event(at_ms * MS, cumulative=tokens, chars=1)
    assert ttfts.exemplars == [(pytest.approx(0.1), ids)]
    # Gaps 20, 10, 40, 10, 50 (x2: two tokens in one event), 10 ms: new largest at 20, 40, 50,
    # and the two-token event's exemplar goes with its first sample only.
    assert [value for value, _ in itl.exemplars] == pytest.approx([0.02, 0.04, 0.05])
    assert len(itl) == 7
    # Without an exemplar (the default), none is ever passed.
    quiet = Observed()
    t = StreamTiming(arrival_ns=0, observe_ttft=quiet.observe, observe_itl=quiet.observe)
    t.event(10 * MS, 1, 1)
    t.event(30 * MS, 2, 1)
    assert len(quiet) == 2 and quiet.exemplars == []


REPLAYS = [pytest.param(itl_oracle.replay_py, id="python-oracle"),
           pytest.param(_native.replay_exact, id="extension")]


@pytest.mark.parametrize("replay", REPLAYS)
@pytest.mark.parametrize("exemplar", [{"request_id": "r1"}, None], ids=["exemplar", "none"])
def test_exact_events_in_one_pass_leave_what_event_by_event_leaves(
        replay: Any, exemplar: Exemplar | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native leg's replay (`exact_events`, in the extension and in Python) against
    `event()` on each logged event: the same timing, record figures and Prometheus histogram
    (buckets, count, exemplars; the sum to rounding), through events without a new token and
    events of several."""
    monkeypatch.setattr(timing_module, "replay_exact", replay)
    rng = random.Random(7)
    log: list[int] = []
    at, count = 100 * MS, 1
    for _ in range(3000):  # past the gap summary's exact limit
        at += rng.choice((0, 1, 3, 12, 40, 250)) * MS + rng.randrange(MS)
        count += rng.choice((0, 1, 1, 1, 2, 5))
        log += [at, count, rng.choice((7, -1))]
    # Last, two gaps in one bucket (0.5-0.75 s), each the largest so far: the bucket's
    # exemplar is the later one's.
    log += [at + 600 * MS, count + 1, 7, at + 1300 * MS, count + 2, 7]
    at, count = at + 1300 * MS, count + 2
    metrics = [ProxyMetrics(CollectorRegistry(), slo_ttft_s=0.5, slo_itl_s=0.0125)
               for _ in range(2)]
    timings = []
    for m in metrics:
        bound = m.bind("m", "completions")
        t = StreamTiming(arrival_ns=0, observe_ttft=bound.observe_ttft,
                         observe_itl=bound.observe_itl,
                         observe_itl_counts=bound.observe_itl_counts, itl_bounds=bound.itl_bounds,
                         exemplar=exemplar)
        t.completion_tokens, t.prompt_tokens = 1, 7
        t.event(100 * MS, 1, 1)
        timings.append(t)
    one_by_one, in_a_pass = timings
    for i in range(0, len(log), 3):
        one_by_one.completion_tokens = log[i + 1]
        one_by_one.prompt_tokens = log[i + 2] if log[i + 2] >= 0 else None
        one_by_one.event(log[i], log[i + 1], 0)
    for start in range(0, len(log), 300):  # as the live passes replay it, a slice at a time
        in_a_pass.exact_events(array("q", log[start:start + 300]))
    for t in timings:
        t.end_ns = at
    assert figures(in_a_pass) == figures(one_by_one)
    assert (in_a_pass.tokens_seen, in_a_pass.prompt_tokens, in_a_pass.completion_tokens) == (
        one_by_one.tokens_seen, one_by_one.prompt_tokens, one_by_one.completion_tokens)

    def exposed(m: ProxyMetrics) -> list[tuple[str, dict[str, str], float, Any]]:
        return [(s.name, s.labels, s.value,
                 s.exemplar and (s.exemplar.labels, s.exemplar.value))
                for family in m.itl.collect() for s in family.samples
                if not s.name.endswith(("_created", "_sum"))]

    def sum_of(m: ProxyMetrics) -> float:
        return next(s.value for family in m.itl.collect() for s in family.samples
                    if s.name.endswith("_sum"))

    assert exposed(metrics[1]) == exposed(metrics[0])
    with_exemplars = [sample for sample in exposed(metrics[0]) if sample[3]]
    if exemplar is None:
        assert not with_exemplars
    else:
        assert len(with_exemplars) > 1  # several buckets had a stream's largest gap so far
    assert sum_of(metrics[1]) == pytest.approx(sum_of(metrics[0]), rel=1e-12)
    assert one_by_one.gaps.count == count - 1 > 3000


def test_a_failing_histogram_never_breaks_the_stream_nor_floods_the_log(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The fault is logged once (its traceback), not once per token of the stream."""
    def broken(_: float, __: object = None) -> None:
        raise RuntimeError("metrics are down")

    monkeypatch.setattr(timing_module, "_OBSERVE_FAULTS", LogThrottle())
    t = StreamTiming(arrival_ns=0, observe_ttft=broken, observe_itl=broken)
    with caplog.at_level("ERROR", logger="phasewatch.proxy.timing"):
        for i in range(1, 101):
            t.event(10 * i * MS, i, 1)
    assert t.first_output_ns == 10 * MS and t.gaps.count == 99
    assert [r.getMessage() for r in caplog.records] == ["could not observe a TTFT"]
    assert caplog.records[0].exc_info is not None


def test_gap_summary_nearest_rank_while_exact() -> None:
    gaps = GapSummary()
    for i in range(1, 101):
        gaps.add(float(i))
    assert gaps.summary() == (100, 50.5, 50.0, 95.0, 100.0) and gaps.exact
    assert GapSummary().summary() == (0, None, None, None, None)


def test_the_extensions_nearest_ranks_are_the_python_percentiles() -> None:
    """`nearest_ranks` (C) gives what `percentile(sorted(...))` gives, for every size up to the
    exact limit, with ties and zero gaps, added between two summaries (the array stays
    sorted from the last one) and in any order."""
    rng = random.Random(11)
    for n in [0, 1, 2, 3, 19, 20, 21, 64, 100, 2047, 2048]:
        values = [rng.choice((0.0, 0.02, rng.lognormvariate(-4, 0.6))) for _ in range(n)]
        gaps = GapSummary()
        for i, value in enumerate(values):
            gaps.add(value)
            if i == n // 2 or i == n - 1:  # a summary midway, then more gaps, then another
                seen = array("d", values[: i + 1])
                expected = itl_oracle.nearest_ranks_py(seen, 0.5, 0.95)
                assert gap_summary.nearest_ranks(array("d", seen), 0.5, 0.95) == expected
                assert gaps.summary()[2:4] == expected
        assert gaps.exact
        for q1, q2 in [(0.0, 1.0), (0.01, 0.99), (0.5, 0.95)]:
            assert gap_summary.nearest_ranks(array("d", values), q1, q2) == \
                itl_oracle.nearest_ranks_py(array("d", values), q1, q2)
    with pytest.raises(TypeError):
        gap_summary.nearest_ranks(b"\0" * 8, 0.5, 0.95)  # read-only: not sorted in place


def test_gap_summary_stays_bounded_and_within_one_percent_past_the_exact_limit() -> None:
    rng = random.Random(7)
    values = [rng.lognormvariate(-4, 0.6) for _ in range(50_000)] + [0.0] * 10
    gaps = GapSummary()
    for v in values:
        gaps.add(v)
    gaps.add(0.02, times=3)
    values += [0.02] * 3
    ordered = sorted(values)
    count, mean, p50, p95, largest = gaps.summary()
    assert not gaps.exact and len(gaps._buckets) < 1000  # memory bounded by the range
    assert count == len(values) and largest == ordered[-1]
    assert mean == pytest.approx(sum(values) / len(values), rel=1e-9)
    assert p50 == pytest.approx(percentile(ordered, 0.5), rel=0.01)
    assert p95 == pytest.approx(percentile(ordered, 0.95), rel=0.01)


@pytest.mark.parametrize(
    ("options", "continuous", "strip_final", "strip_chunks", "sent"),
    [
        (None, True, True, True, {"include_usage": True, "continuous_usage_stats": True}),
        ({"include_usage": True}, True, False, True,
         {"include_usage": True, "continuous_usage_stats": True}),
        ({"include_usage": True, "continuous_usage_stats": True}, True, False, False, None),
        (None, False, True, False, {"include_usage": True}),
        ({"include_usage": True}, False, False, False, None),
    ],
)
def test_plan_asks_for_usage_and_remembers_what_to_strip(
    options: dict[str, bool] | None, continuous: bool, strip_final: bool, strip_chunks: bool,
    sent: dict[str, bool] | None,
) -> None:
    request = {"model": "m", "prompt": "x", "stream": True}
    if options is not None:
        request["stream_options"] = options
    body = orjson.dumps(request)
    plan = plan_request(body, continuous)
    assert (plan.model, plan.stream) == ("m", True)
    assert (plan.strip_final_usage, plan.strip_chunk_usage) == (strip_final, strip_chunks)
    if sent is None:
        assert plan.body is body  # unchanged, byte for byte
    else:
        assert orjson.loads(plan.body) == {**request, "stream_options": sent}


ASKED = b'"stream_options":{"include_usage":true,"continuous_usage_stats":true}'


def test_plan_appends_stream_options_to_the_body_as_it_came() -> None:
    """Spacing, key order, number spellings and escapes all reach the upstream as sent."""
    body = (b'{ "model" : "m\\u00e9", "prompt": "a\\/b\\n\\"}", "stream": true,\n'
            b'  "temperature": 1e-1, "seed": 1E5, "logit_bias": {"7": -1.50} }\r\n')
    plan = plan_request(body, True)
    head, tail = body.rsplit(b"}", 1)
    assert plan.body == head + b"," + ASKED + b"}" + tail
    assert orjson.loads(plan.body) == {**orjson.loads(body), "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}
    assert (plan.model, plan.stream, plan.strip_final_usage, plan.strip_chunk_usage) == (
        "m\u00e9", True, True, True)


@pytest.mark.parametrize("body", [
    b'{"stream": true, "stream_options": null}',
    b'{"stream": true, "stream\\u005foptions": null}',  # the same key, escaped
    b'{"stream": true, "stream_options": {"include_usage": true}}',
])
def test_plan_writes_a_body_anew_where_its_own_stream_options_change(body: bytes) -> None:
    """One `stream_options` member reaches the upstream, never a second beside the client's."""
    plan = plan_request(body, True)
    assert plan.body == b'{"stream":true,' + ASKED + b"}"


def test_plan_leaves_non_streaming_and_non_json_bodies_alone() -> None:
    body = b'{"model":"m","prompt":"x"}'
    assert plan_request(body, True).body is body
    assert plan_request(b"{not json", True).body == b"{not json"
    assert plan_request(b'{"stream":true,"stream_options":"bad"}', True).strip_final_usage is False


@pytest.mark.parametrize("exemplars", [True, False])
def test_the_extensions_replay_is_the_python_replay_to_the_bit(exemplars: bool) -> None:
    """`replay_exact` (C) returns exactly what `replay_py` returns, every double equal, from
    random logs: gaps of zero and on a bucket's bound, counts that stand still or jump, times
    that go back."""
    rng = random.Random(11)
    bounds = array("d", [0.001, 0.005, 0.0125, 0.02, 0.05, 0.1, 0.25, 1.0, float("inf")])
    for _ in range(200):
        at, count = rng.randrange(1 << 40), rng.randrange(3)
        log = array("q")
        for _ in range(rng.randrange(40)):
            # Some gaps fall exactly on a bucket's bound (1, 5 and 20 ms after one token).
            at += rng.choice((0, 1, 999, 10**6, 5 * 10**6, 20 * 10**6, 37 * 10**6, -5))
            at += rng.choice((0, rng.randrange(1000)))
            count += rng.choice((0, 1, 1, 2, 7, -1))
            log.extend((at, count, rng.choice((3, -1))))
        args = (log, rng.randrange(3), at - rng.randrange(10**8), rng.random() / 10,
                rng.random(), bounds, exemplars)
        assert _native.replay_exact(*args) == itl_oracle.replay_py(*args)
    with pytest.raises(ValueError):
        _native.replay_exact(b"\0" * 23, 0, 0, 0.0, 0.0, bounds, False)


@pytest.mark.parametrize("replay", REPLAYS)
def test_the_replays_work_goes_with_the_events_not_the_tokens_they_claim(replay: Any) -> None:
    """An event that says it carries millions of tokens is one gap and one count in what the
    replay returns, not millions; a count past MAX_TOKEN_COUNT (2**62 here, as a broken
    upstream might send) carries no token at all, and the count goes on from where it
    stood."""
    bounds = array("d", [0.001, 0.02, 1.0, float("inf")])
    big = MAX_TOKEN_COUNT - 3
    log = array("q", [1 * NS, 2, 7, 2 * NS, 3, 7, 3 * NS, 2**62, 7, 4 * NS, MAX_TOKEN_COUNT, 7])
    gaps, tokens, counts, sample_sum, _, seen, last, total, largest = replay(
        log, 1, 0, 0.0, 0.0, bounds, False)
    assert array("d", gaps).tolist() == [1.0, 1.0, 2.0 / big]  # 1 s, 1 s, then 2 s / big
    assert tokens is not None and array("q", tokens).tolist() == [1, 1, big]
    assert counts == [(0, big), (2, 2)]
    assert (seen, last, largest) == (MAX_TOKEN_COUNT, 4 * NS, 1.0)
    assert sample_sum == total == 1.0 + 1.0 + 2.0 / big * big
    # What the stream's record keeps of it: the same as `add` on each event, in a bounded
    # summary (past the exact limit: buckets).
    summary, reference = GapSummary(), GapSummary()
    summary.extend(gaps, tokens, total, largest)
    for gap, k in zip(array("d", gaps), array("q", tokens), strict=True):
        reference.add(gap, k)
    assert summary.summary() == reference.summary() and not summary.exact
    assert summary.count == 2 + big


def test_gap_summary_takes_the_replays_events_as_add_takes_them() -> None:
    """`extend` with one token per event, and with several, before and across the exact
    limit: the same summary as `add` on each event in turn."""
    rng = random.Random(3)
    for per_event in (None, (1, 1, 2, 5)):
        summary, reference = GapSummary(), GapSummary()
        for _ in range(300):  # 3,000 tokens or more: the limit is crossed inside a batch
            gaps = array("d", [rng.lognormvariate(-4, 0.6) for _ in range(10)])
            counts = array("q", [1 if per_event is None else rng.choice(per_event)
                                 for _ in gaps])
            for gap, k in zip(gaps, counts, strict=True):
                reference.add(gap, k)
            summary.extend(gaps.tobytes(), None if per_event is None else counts.tobytes(),
                           reference.total, reference.largest)
            assert summary.summary() == reference.summary()
            assert summary.exact == reference.exact
        assert not summary.exact


def test_a_usage_count_is_taken_only_as_what_it_can_be() -> None:
    """A count that is not an integer from 0 to MAX_TOKEN_COUNT reads as absent, in every
    kind of event that carries usage."""
    for value, read in [(0, 0), (12, 12), (MAX_TOKEN_COUNT, MAX_TOKEN_COUNT),
                        (MAX_TOKEN_COUNT + 1, None), (2**70, None), (-1, None), ("12", None),
                        (12.0, None), (True, None), (None, None), ([1], None)]:
        assert token_count(value) == read
        number = b"%d" % value if type(value) is int else orjson.dumps(value)  # 2**70 too
        usage = b'{"prompt_tokens":%b,"completion_tokens":%b}' % (number, number)
        chunk = b'{"choices":[{"index":0,"text":"x","finish_reason":null}],"usage":%b}' % usage
        info = classify(chunk)
        assert (info.kind, info.completion_tokens, info.prompt_tokens) == (Kind.OUTPUT, read,
                                                                           read)
        info = classify(b'{"choices":[],"usage":%b}' % usage)
        assert (info.kind, info.completion_tokens, info.prompt_tokens) == (Kind.USAGE, read,
                                                                           read)


def test_a_model_name_is_cleaned_of_every_control_character_and_only_of_those() -> None:
    """`model_name` keeps a printable name as it is and runs the substitution on any other:
    the same as substituting every name, for each character of the Basic Multilingual Plane
    alone and among others."""
    for code in range(0x10000):
        name = f"m{chr(code)}x"
        assert model_name(name) == _CONTROL.sub("\ufffd", name), hex(code)
    assert model_name("a\x00b\x7fc\x9f") == "a\ufffdb\ufffdc\ufffd"
    assert model_name("org/model-7b") == "org/model-7b"
