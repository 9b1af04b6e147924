"""Optimisation attacks: gradient matching and its terms, Inverting Gradients from a closed-form
start, the batch fit, breaching's attacks, and the MJP-aware span fit (``mjp_adaptive``)."""
