"""What surrounds a training run of ``recipes/grpo.py``: recipes shared on the Hub (:mod:`.hub`) and the trust
they need (:mod:`.trust`), datasets (:mod:`.data`) and reward functions by name (:mod:`.rewards`), the run's
summary (:mod:`.summary`) and its live progress line and report plot (:mod:`.report`)."""
