"""The one base class of every mistake a user makes in the options or the data (as opposed to a bug).

:class:`InputError` is a ``ValueError`` (code that catches ``ValueError`` keeps working). Everything that rejects a
user's input derives from it: invalid options (:class:`~trl_nrollout.plan.layout_rules.LayoutError`,
:class:`~trl_nrollout.config.trl_options.UnsupportedTRLOption`, the checks of :class:`~trl_nrollout.config.NRolloutConfig`),
datasets (:class:`DatasetError`) and recipes (:class:`~trl_nrollout.recipe.hub.HubError`). Its message names the option,
file or function, the value, the rule and a fix, so the recipe script prints the message alone, without a
traceback (a traceback is for bugs), and exits with status 2.
"""

from __future__ import annotations


class InputError(ValueError):
    """An invalid option, recipe or dataset; the message names it, the rule and a fix."""


class DatasetError(InputError):
    """A dataset a recipe cannot train on (an empty file, a malformed line, an empty prompt...); the message names
    the file (and line or row where known) and what a dataset must look like."""
