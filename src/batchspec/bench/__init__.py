"""`batchspec bench`: policies and baselines side by side on the same prompts, reports and plots."""
