"""specops.bench."""
