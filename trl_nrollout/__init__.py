"""trl_nrollout."""
