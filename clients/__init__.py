"""Federated clients, one job per module:

- ``clients.runconfig``: the run-config keys, their defaults and validation, the model spec;
- ``clients.partition``: which private images each client owns, the per-round private batch and its
  MJP shuffle (the ground truth the benchmark scores against), the public split no client owns;
- ``clients.update``: local compute in plain PyTorch (loss, FedSGD gradients, FedAvg deltas);
- ``clients.defence``: the same round with a client-side defence;
- ``clients.client_app``: the thin Flower ClientApp around them.

Submodules are not imported here so that everything but ``clients.client_app`` stays Flower-free.
"""
