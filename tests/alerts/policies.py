"""Policies used by the alert tests."""

TEST_POLICY = """\
version: "alerts-test-1"
description: two classes, three rules
default_class: chat
classes:
  - name: code
    method: draft
  - name: chat
    method: draft
  - name: creative.v2
    method: ngram
alerts:
  - name: speedup-below-1
    metric: speedup
    op: "<"
    threshold: 1
    for_s: 120
    min_samples: 100
    action: fallback
    severity: critical
  - name: code_acceptance_low
    metric: acceptance_rate
    op: "<="
    threshold: 0.5
    for_s: 0
    min_samples: 10
    action: notify
    severity: warning
    classes: [code, creative.v2]
  - name: head-accuracy-low
    metric: head_accuracy
    op: "<"
    threshold: 0.2
    for_s: 90.5
    action: rollback
    severity: info
rollout:
  analysis: {window_s: 300}
"""


def e2e_policy(for_s: float = 2) -> str:
    """One fallback rule with a short `for`, for the end-to-end alert path."""
    return f"""\
version: "e2e-1"
default_class: chat
classes:
  - name: chat
  - name: creative
alerts:
  - name: speedup-below-1
    metric: speedup
    op: "<"
    threshold: 1
    for_s: {for_s}
    min_samples: 10
    action: fallback
    severity: critical
"""
