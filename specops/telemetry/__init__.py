"""specops.telemetry."""
