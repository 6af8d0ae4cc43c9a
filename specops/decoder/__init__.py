"""specops.decoder."""
