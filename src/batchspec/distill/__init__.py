"""`batchspec distill`: a draft model distilled from the target on Python-function prompts."""
