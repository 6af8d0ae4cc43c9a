"""specops.policies."""
