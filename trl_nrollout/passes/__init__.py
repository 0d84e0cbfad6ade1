"""Forward passes over a rollout's samples outside the update: the old-policy and reference log-prob passes
(:mod:`.logprobs`), the shared-prompt packed layout they and the update use (:mod:`.packing`; its arithmetic,
without torch, in :mod:`trl_nrollout.plan.packing_rules`, which ``plan``'s cost model shares), the critic's value
pass (:mod:`.critic`) and a vision-language model's image inputs (:mod:`.multimodal`); and the one home of what
sharded training asks of them (:mod:`.distributed`: ZeRO-3 / FSDP, as many forwards as the busiest rank)."""
