"""specops.train: the bundled models and the training commands.

Modules, one concept each: ``data`` (stdlib corpus, held-out split, token windows),
``tokenizer`` (byte-level BPE), ``target`` (the Llama target and the shared training
loop), ``distill`` (draft distillation, KL to the target), ``evaluate`` (greedy
acceptance of a draft), ``checkpoint`` (fp16 safetensors that load as float32),
``tiny`` (``specops train tiny``), ``cli`` (click commands). Medusa heads live in
``heads`` / ``cli_heads``.
"""
