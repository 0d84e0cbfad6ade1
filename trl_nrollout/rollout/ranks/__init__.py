"""Placement on rollout ranks (``rollout_ranks``): the same drivers run there. The trainers' client of the
engines (``client.py``: ``RemoteEngines``), the rollout ranks' loop (``serve.py``: a handler per message), their
reader of messages and weight versions (``reader.py``), weight buckets and their deltas (``buckets.py``,
``weight_delta.py``), a handler per kind of job (``jobs.py``, ``JOB_KINDS``), the rank's state (``state.py``), whole
episodes as jobs (``episodes.py``) and the pools of groups in flight there (``partial.py``). The launch's two worlds
and the bridge between them are below every engine: :mod:`trl_nrollout.rollout.bridge`."""
