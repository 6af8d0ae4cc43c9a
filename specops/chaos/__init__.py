"""`specops chaos`: failure scenarios against real local processes, with figures and goals."""
