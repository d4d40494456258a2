"""A run's memory: what each rank will need, forecast from the static plan by part and phase (``forecast``, from
``parts``; for a run's config, ``run_forecast``, what ``recipes/plan.py`` prints), what fits a budget
(``micro_batch``: ``trainer.accum_steps=auto``; ``auto_stage``: ``trainer.zero_stage=auto``), and what a rank
that ran out says (``out_of_memory``).
"""
