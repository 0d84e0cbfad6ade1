"""What an episode is, and how one engine's request loop runs it (over :mod:`trl_nrollout.rollout.engines`):
TRL tool episodes turn by turn or request by request (``tools.py``) and stopped at a partial end with their tokens
kept (``partial_tools.py``), single-turn samples and groups in flight (``in_flight.py``: staleness, homes, the loop
stopped at a target), endpoint agents' OpenAI-compatible endpoint and recorded calls (``endpoint.py``,
``agent_calls.py``), a ``rollout_func`` run group by group (``rollout_func.py``), tool calls that go home to the
rank holding the environment (``home_tools.py``) and the images tools return (``tool_images.py``)."""
