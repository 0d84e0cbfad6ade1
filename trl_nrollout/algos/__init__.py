"""The algorithms, as pure functions over tensors: advantage estimators (a registry, :mod:`.advantages`), policy
and value losses, KL estimators and controllers (:mod:`.losses`), and group helpers for DAPO's filtering and batch
balancing (:mod:`.batching`)."""
