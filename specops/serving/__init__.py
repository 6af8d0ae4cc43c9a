"""Serving: applies the live policy to the decoding runtime (``policy_runtime``) and,
with the HTTP server and continuous-batching engine, runs it as an inference pod."""
