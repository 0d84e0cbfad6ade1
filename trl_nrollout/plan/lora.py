"""``rollout_lora_sync="auto"`` by price: a LoRA policy's step with merged-weight sync against the same step with the
engines serving the adapter, from the cost model (:func:`~trl_nrollout.plan.cost.predict_step`). Merged sync moves
the model's bytes per step (through host memory to rollout ranks); adapter sync moves the adapter's bytes but every
generation runs vLLM's LoRA kernels (:meth:`~trl_nrollout.plan.devices.DeviceProfile.lora_slowdown`, measured by
``plan --calibrate``). ``auto`` picks the cheaper whole step. Pure: no torch at import."""

from __future__ import annotations

from dataclasses import dataclass, replace

from trl_nrollout.plan.cost import predict_step
from trl_nrollout.plan.devices import DeviceProfile
from trl_nrollout.plan.dims import ModelDims
from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.plan.search import predict_split
from trl_nrollout.plan.workload import Workload


@dataclass(frozen=True)
class LoraSyncPrice:
    """Both sync modes of one LoRA step, priced. ``merged_s`` / ``adapter_s``: the predicted step (seconds) with
    each; ``sync_saved_s``: the weight sync's seconds adapter sync saves; ``generation_added_s``: the generation's
    seconds the LoRA kernels add; ``slowdown``: the device's generation slowdown at the adapter's rank; ``choice``:
    the cheaper mode (``"merged"`` on a tie: no kernels to risk)."""

    merged_s: float
    adapter_s: float
    sync_saved_s: float
    generation_added_s: float
    slowdown: float
    choice: str

    def reason(self) -> str:
        """One line saying what ``auto`` chose and why, in seconds per step."""
        return (f"rollout_lora_sync='auto' -> {self.choice!r}: a step priced {self.adapter_s:.3g} s with the adapter "
                f"(sync {self.sync_saved_s:.3g} s shorter, generation {self.generation_added_s:.3g} s longer at the "
                f"LoRA kernels' {self.slowdown:.3g}x) against {self.merged_s:.3g} s merged")


def price_lora_sync(dims: ModelDims, layout: RolloutLayout, work: Workload, dev: DeviceProfile, *,
                    engines: RolloutLayout | None = None, cross_node: bool = False, staleness: int = 0
                    ) -> LoraSyncPrice:
    """Price ``work``'s LoRA step (``work.lora_r`` set) with merged and with adapter sync, and choose the cheaper:
    colocated on ``layout``, or (``engines`` given) on rollout ranks with ``layout`` the trainers' (the transfer
    through host memory; ``staleness`` > 0: the pipelined step). ValueError without a LoRA rank."""
    if work.lora_r is None:
        raise ValueError("price_lora_sync needs a LoRA workload (lora_r set): a full-weight policy has one sync mode.")
    steps, syncs, gens = {}, {}, {}
    for mode in ("merged", "adapter"):
        w = replace(work, lora_sync=mode)
        if engines is None:
            pred = predict_step(dims, layout, w, dev)
            steps[mode], syncs[mode], gens[mode] = pred.total_s, pred.phases["weight_sync"], pred.phases["generation"]
        else:
            split = predict_split(dims, engines, layout, w, dev, cross_node=cross_node)
            steps[mode], syncs[mode], gens[mode] = split.step_s(staleness), split.transfer_s, split.generation_s
    return LoraSyncPrice(
        merged_s=steps["merged"], adapter_s=steps["adapter"], sync_saved_s=syncs["merged"] - syncs["adapter"],
        generation_added_s=gens["adapter"] - gens["merged"], slowdown=dev.lora_slowdown(work.lora_r),
        choice="adapter" if steps["adapter"] < steps["merged"] else "merged")
