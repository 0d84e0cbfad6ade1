"""What a layout costs, before anything runs: the rollout layout and its rules (:mod:`.layout`,
:mod:`.layout_rules`), the memory estimate (:mod:`.memory`) and the figures of ``trl-nrollout plan``
(:mod:`.figures`). Pure arithmetic over the options and the model's config: no torch at import."""
