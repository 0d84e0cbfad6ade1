"""The one pool of partial rollouts (``rollout_partial=True``), over any dispatch
(:mod:`trl_nrollout.rollout.dispatch`): its step for every episode kind and placement (``pool.py``: top-up,
restart of stale groups, run, split by home, counts) and the pool of live endpoint agents or ``rollout_func``
groups (``agent_pool.py``)."""
