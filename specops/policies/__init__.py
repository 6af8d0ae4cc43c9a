"""specops.policies: YAML speculation policies, their state in Redis, and canary rollouts.

Torch-free (enforced by import-linter): the controller and the CLI import this.
"""

from specops.policies.errors import ConflictError, PolicyError, PolicyIssue, StaleEpochError, StateError
from specops.policies.loader import load_policy, parse_policy
from specops.policies.schema import (
    Adaptation,
    AlertRule,
    Analysis,
    FloatRange,
    IntRange,
    MatchRule,
    Policy,
    RequestClass,
    Rollout,
    RolloutStep,
)

__all__ = [
    "Adaptation", "AlertRule", "Analysis", "ConflictError", "FloatRange", "IntRange", "MatchRule", "Policy",
    "PolicyError", "PolicyIssue", "RequestClass", "Rollout", "RolloutStep", "StaleEpochError", "StateError",
    "load_policy", "parse_policy",
]
