"""The sidecar for vLLM / SGLang / specops pods: a class-aware OpenAI proxy (routing by the live
policy, per-class telemetry from the engines' own fields, engine counters with a ``pool`` label)."""
