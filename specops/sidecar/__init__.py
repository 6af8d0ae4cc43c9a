"""The sidecar for vLLM / SGLang / llama.cpp / specops pods: a class-aware OpenAI proxy (routing by the live
policy, per-class telemetry from the engines' own fields, engine counters with a ``pool`` label).

Each request's Redis record has one writer (``--records``, see `specops.sidecar.server`): a
``specops serve`` engine records its own requests, so by default the sidecar writes records
only for vLLM / SGLang / llama.cpp pools."""
