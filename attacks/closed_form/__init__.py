"""Closed-form reads of an update: the first layer's equations (:mod:`.first_layer`), APRIL, the
position-embedding closed form, their noise-robust form (``april_robust``), label counts from the
head, and the MJP maths (the reduction of an MJP update and its priors)."""
