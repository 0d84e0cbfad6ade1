"""trl_nrollout."""

from trl_nrollout.quiet import silence_known_warnings

__version__ = "0.1.0"

silence_known_warnings()  # warnings that ask nothing of the user (see quiet.py); before TRL or vLLM is imported

__all__ = ["NRolloutConfig", "NRolloutDistillationConfig", "NRolloutDistillationTrainer", "NRolloutGRPOTrainer",
           "NRolloutPPOConfig", "NRolloutPPOTrainer", "RolloutLayout", "compute_advantages", "__version__"]


def __getattr__(name: str):
    # lazy: `trl-nrollout plan` must not import torch / trl
    if name == "NRolloutConfig":
        from trl_nrollout.config.options import NRolloutConfig

        return NRolloutConfig
    if name == "NRolloutGRPOTrainer":
        from trl_nrollout.trainer.grpo import NRolloutGRPOTrainer

        return NRolloutGRPOTrainer
    if name in ("NRolloutPPOConfig", "NRolloutPPOTrainer"):
        from trl_nrollout.trainer import ppo

        return getattr(ppo, name)
    if name == "NRolloutDistillationConfig":
        from trl_nrollout.config.distillation import NRolloutDistillationConfig

        return NRolloutDistillationConfig
    if name == "NRolloutDistillationTrainer":
        from trl_nrollout.trainer.distillation import NRolloutDistillationTrainer

        return NRolloutDistillationTrainer
    if name == "RolloutLayout":
        from trl_nrollout.plan.layout import RolloutLayout

        return RolloutLayout
    if name == "compute_advantages":
        from trl_nrollout.algos.advantages import compute_advantages

        return compute_advantages
    raise AttributeError(name)
