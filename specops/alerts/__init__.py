"""specops.alerts."""
