"""Rollout engines: the protocol, the Ray-free vLLM engine group, the HF ``generate`` engine, weight sync."""

from trl_nrollout.rollout.dispatch import rules as _rules  # noqa: F401  (registers the built-in dispatch rules)
from trl_nrollout.rollout.engines.build import HFEngineSettings, VLLMEngineSettings, build_engine
from trl_nrollout.rollout.engines.hf_engine import HFEngine
from trl_nrollout.rollout.engines.protocol import RolloutEngine
from trl_nrollout.rollout.engines.weight_sync import iter_weight_buckets
from trl_nrollout.rollout.types import RolloutBatch, SamplingOptions

__all__ = ["HFEngine", "HFEngineSettings", "RolloutBatch", "RolloutEngine", "SamplingOptions", "VLLMEngineGroup",
           "VLLMEngineSettings", "build_engine", "iter_weight_buckets"]


def __getattr__(name: str):
    if name == "VLLMEngineGroup":  # imported lazily: importing it does not import vllm, but keep the package light
        from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup

        return VLLMEngineGroup
    raise AttributeError(name)
