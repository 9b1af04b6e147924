"""Numerics every attack shares: Levenberg-Marquardt (dense, batched, matrix-free; :mod:`.lm`), conjugate
gradients (:mod:`.linalg`), layers' input spans (:mod:`.spans`) and the jigsaw solver (:mod:`.jigsaw`).
Imports no other part of attacks."""
