"""specops.spec: the speculative step and what it is made of.

The step loop and its accounting:
``step`` (one step: propose, verify, accept, commit; `Proposer`, `run_steps`),
``speculation`` (`TargetVerifier`: the target's verify forward and the committed state),
``verify`` (acceptance rules for a chain), ``tree_verify`` (acceptance over a token tree),
``tree`` (tree shapes and their buffers), ``tree_size`` (tree sizes from measured verify cost),
``sampling`` (filters and draws), ``schedule`` (γ schedules), ``stats`` (`DecodeStats`).

The proposers, one per method:
``autoregressive`` (plain decoding), ``draft`` and ``async_draft`` (a draft model),
``ngram`` and ``ngram_store`` (prompt / corpus n-grams), ``eagle`` and ``eagle_tree``
(an EAGLE drafter over the target's features), ``medusa_decode`` and ``medusa_branch``
(Medusa heads, trees with an n-gram branch), ``auto`` with ``chooser`` (the method picked per step).

Shared leaves: ``errors`` (the runtime's error classes), ``request`` (request checks and stop
rules), ``clock`` (device-synchronised timing).

The models these run on (runners, drafter and heads modules) are in `specops.models`;
`specops.decoder.Decoder` is the public entry point over both.
"""
