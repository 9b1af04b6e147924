"""The attacked model's top-1 read off a single-image FedSGD gradient equals its forward pass.

For one image, the classifier-bias gradient of the cross-entropy is softmax(logits) - onehot(y);
the benchmark reads the prediction there instead of running a second forward per update. These
tests check the read-out against the forward on real gradients of real (untrained, so nearly
uniform: the hardest case) MJP ViTs, its refusals, and that the pipeline uses it.
"""
from __future__ import annotations

import torch

import fedmjp  # noqa: F401  (registers the mjp_* models)
from benchmark import scoring
from clients.partition import PrivateBatch
from clients.update import fedsgd_gradients, model_logits
from fedmjp.factory import build_model

SPEC = {"name": "t", "arch": "mjp_vit_cifar_patch4_32", "variant": "mjp", "april": None, "checkpoint": None,
        "kwargs": {"depth": 1, "num_classes": 100}, "seed": 3}
#: Forward top-two logit margins below this are at float32's noise floor (batch sizes and summation
#: order move logits by ~1e-6); only images above it are compared.
CLEAR_MARGIN = 1e-4


def _batch(images: torch.Tensor, labels: torch.Tensor) -> PrivateBatch:
    return PrivateBatch(images, labels, [f"i{i}" for i in range(len(labels))], torch.arange(len(labels)),
                        None, None, 0.0)


def test_classifier_bias_name_of_a_timm_vit():
    assert scoring.classifier_bias_name(build_model(SPEC)) == "head.bias"
    assert scoring.classifier_bias_name(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None


def test_readout_equals_the_forward_prediction_on_real_gradients():
    model = build_model(SPEC)
    g = torch.Generator().manual_seed(0)
    images = torch.rand(40, 3, 32, 32, generator=g)
    labels = torch.randint(0, 100, (40,), generator=g)
    compared = declined = 0
    for x, y in zip(images, labels):
        batch = _batch(x[None], y[None])
        grads, _ = fedsgd_gradients(model, batch)
        got = scoring.prediction_from_gradient(grads["head.bias"], int(y))
        with torch.no_grad():
            logits = model_logits(model, x[None])[0].double()
        top = logits.topk(2).values
        if float(top[0] - top[1]) < CLEAR_MARGIN:
            continue
        compared += 1
        declined += got is None
        if got is not None:
            assert got == int(logits.argmax())
    assert compared >= 30 and declined == 0


def test_readout_declines_what_is_not_a_plain_single_image_gradient():
    model = build_model(SPEC)
    g = torch.Generator().manual_seed(1)
    images, labels = torch.rand(2, 3, 32, 32, generator=g), torch.tensor([4, 9])
    one, _ = fedsgd_gradients(model, _batch(images[:1], labels[:1]))
    assert scoring.prediction_from_gradient(one["head.bias"], 4) is not None
    # a noised (DP-like) gradient is no distribution after adding e_y
    noisy = one["head.bias"] + 0.05 * torch.randn(100, generator=g)
    assert scoring.prediction_from_gradient(noisy, 4) is None
    # a two-image mean gradient: after adding one label's e_y, the other label's entry stays negative
    two, _ = fedsgd_gradients(model, _batch(images, labels))
    assert scoring.prediction_from_gradient(two["head.bias"], 4) is None
    # an exact tie at the top
    tie = torch.zeros(100)
    tie[[1, 2]] = 0.5
    tie[1] -= 1.0
    assert scoring.prediction_from_gradient(tie, 1) is None
    assert scoring.prediction_from_gradient(one["head.bias"], 100) is None  # label out of range
