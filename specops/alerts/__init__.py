"""specops.alerts: alert rules rendered from policies, webhook receivers, the controller's HTTP server.

Torch-free (enforced by import-linter).
"""

from specops.alerts.webhook import AlertAction, WebhookError, WebhookReceiver

__all__ = ["AlertAction", "WebhookError", "WebhookReceiver"]
