"""The one error the bench raises on purpose: the target cannot be measured, and why."""

from __future__ import annotations


class WorkloadError(RuntimeError):
    """The server could not be prepared for (its models, its tokenizer, its API); the message
    says why. Failed requests are never raised: they are counted in the results."""
