"""Experiment scripts above the core: the paper's tables on trained checkpoints
(:mod:`.paper_tables`, ``python -m experiments.paper_tables``), the position-embedding analyses
(:mod:`.pe_analysis`, ``python -m experiments.pe_analysis``) and the seeded ImageNet-C corruptions
they use (:mod:`.corruptions`). They read models, data and statistics from ``fedmjp``; nothing
below imports them.
"""
