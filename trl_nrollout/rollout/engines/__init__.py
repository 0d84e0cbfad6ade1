"""The engines, at the bottom of the rollout: the protocol every engine implements (``protocol.py``: a core and
optional capabilities), the Ray-free vLLM engine group (``vllm_group.py``; its process, settings and weights in
``vllm_process.py``, ``vllm_settings.py``, ``vllm_weights.py``; its request-level loop ``requests.py``; CPU shared
memory and platform quirks ``cpu_shm.py``, ``platform.py``), the HF ``generate`` engine (``hf_engine.py``), weight
sync (``weight_sync.py``) and the one engine builder (``build.py``). Nothing here imports a driver: modules of this
folder import only each other and ``rollout/``'s own modules (types, seeds, axes, bridge)."""
