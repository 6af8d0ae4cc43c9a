"""specops.controller."""
