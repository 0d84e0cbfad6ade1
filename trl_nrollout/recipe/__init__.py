"""What surrounds a training run of the recipe (``trl-nrollout train``, :mod:`.run`; :mod:`.launch` under accelerate): recipes shared on the Hub (:mod:`.hub`) and the trust
they need (:mod:`.trust`), datasets (:mod:`.data`) and reward functions by name (:mod:`.rewards`), the run's
summary (:mod:`.summary`) and its live progress line and report plot (:mod:`.report`)."""
