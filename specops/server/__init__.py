"""`specops serve`: the OpenAI-compatible HTTP app (module-level routes), its protocol models,
chat templates, and the process that runs the engine behind it (`server`)."""
