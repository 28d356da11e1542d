"""The current verdict per model as Prometheus metrics, on an injected registry.

`phasewatch_diagnosis_verdict{model, verdict}` is 1 for the model's current verdict and 0 for the
seven others (every label value is always present once a model has been judged, so an alert can
match `== 1` without `absent()` games); `phasewatch_diagnosis_confidence{model}` is that verdict's
confidence, 0-1 (0 for insufficient data). Models are those the scheduled evaluation judges
(app/phasewatch/diagnosis/service.py): at most `max_model_labels` at any time, only names the
upstream served, and a model's series are removed when it goes quiet.

Only the process that runs the schedule (the leader, app/phasewatch/store/leader.py) sets them; when
it stops leading it withdraws them: removed, or, under several workers (where prometheus_client
keeps every series in the process's file and cannot remove one), set to 0, which `max by` reads as
nothing; the same for a model that went quiet. Both gauges are `livemax` across workers, so a dead
leader's values go with it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from phasewatch.diagnosis.verdicts import Verdict


class DiagnosisMetrics:
    def __init__(self, registry: CollectorRegistry, multiprocess: bool = False) -> None:
        self.multiprocess = multiprocess
        self.verdict = Gauge(
            "phasewatch_diagnosis_verdict",
            "1 for the model's current diagnosis verdict, 0 for the others.",
            ("model", "verdict"), registry=registry, multiprocess_mode="livemax",
        )
        self.confidence = Gauge(
            "phasewatch_diagnosis_confidence",
            "Confidence of the model's current diagnosis verdict, 0-1.",
            ("model",), registry=registry, multiprocess_mode="livemax",
        )
        self._models: set[str] = set()  # models with series set, to withdraw
        self.evaluations = Counter(
            "phasewatch_diagnosis_evaluations",
            "Scheduled diagnosis evaluations (one per model per round).",
            registry=registry,
        )
        self.failures = Counter(
            "phasewatch_diagnosis_evaluation_failures",
            "Scheduled diagnosis evaluations that failed (database or evaluation error).",
            registry=registry,
        )

    def set(self, model: str, verdict: Verdict, confidence: float) -> None:
        for each in Verdict:
            self.verdict.labels(model, each.value).set(1.0 if each is verdict else 0.0)
        self.confidence.labels(model).set(confidence)
        self._models.add(model)

    def remove(self, model: str) -> None:
        """`model` is no longer judged: its series go (set to 0 under several workers)."""
        if model not in self._models:
            return
        self._models.discard(model)
        for each in Verdict:
            if self.multiprocess:
                self.verdict.labels(model, each.value).set(0.0)
            else:
                self.verdict.remove(model, each.value)
        if self.multiprocess:
            self.confidence.labels(model).set(0.0)
        else:
            self.confidence.remove(model)

    def withdraw(self) -> None:
        """This process no longer judges: its verdicts must not be read as current."""
        if self.multiprocess:
            for model in self._models:
                for each in Verdict:
                    self.verdict.labels(model, each.value).set(0.0)
                self.confidence.labels(model).set(0.0)
        else:
            self.verdict.clear()
            self.confidence.clear()
        self._models.clear()
