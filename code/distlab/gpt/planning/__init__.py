"""Plan a large run before paying for it: dry runs of one rank at full size (dry_run, collectives),
a step-time model (hardware, step_model) and a planner that ranks the layouts that fit (planner)."""
