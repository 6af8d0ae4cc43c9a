"""Record factories shared by the telemetry and alert tests."""

from __future__ import annotations

from specops.telemetry import DecodeRecord


def make_record(request_class: str = "code", method: str = "draft", **overrides) -> DecodeRecord:
    """A consistent record: 20 tokens, 16 drafted at γ=4, 12 accepted, 1.5x speed-up."""
    fields = dict(
        request_class=request_class,
        method=method,
        new_tokens=20,
        drafted=16,
        accepted=12,
        accepted_per_pos=[4, 4, 3, 1],
        target_forwards=5,
        draft_s=0.1,
        verify_s=0.3,
        wall_s=0.4,
        plain_s_estimate=0.6,
        token_latencies_s=[0.02] * 20,
        head_predictions=[],
        head_correct=[],
        gamma=4,
        heads=0,
        fallback_reason=None,
    )
    fields.update(overrides)
    return DecodeRecord(**fields)
