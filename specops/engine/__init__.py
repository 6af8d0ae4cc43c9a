"""The continuous-batching engine of `specops serve`: scheduler, paged KV pool, sequences, the
drafters of a batch behind one interface (`proposers.GroupProposer`), the speculation planner, and
the engine thread (`async_engine`) that applies the live policy per request class
(`policy_runtime`). Its speculative rules are the library's (`specops.spec`)."""
