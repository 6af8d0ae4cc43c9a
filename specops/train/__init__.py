"""specops.train."""
