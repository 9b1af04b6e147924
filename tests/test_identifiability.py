"""Image identifiability precision (metrics/identifiability.py) picks what breaching's
``image_identifiability_precision`` picks, on the same reconstructions and pool of real
photographs, for each of its distances (pixel, LPIPS, the model's own features)."""
from __future__ import annotations

import pytest
import timm
import torch
from breaching.analysis.metrics import image_identifiability_precision

import fedmjp  # noqa: F401  (registers the models)
import metrics
from fedmjp.data import load_images
from metrics.identifiability import head_features, identified


class _Pool(torch.utils.data.Dataset):
    """The shape breaching's IIP reads: ``dataset.lookup`` (index -> label) and ``dataset[i][0]``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.lookup = images, {i: int(y) for i, y in enumerate(labels)}

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return self.images[i], self.lookup[i]


@pytest.fixture(scope="module")
def pool():
    s = load_images("embedded", 32, None, 3)  # 19 photographs, labels index % 3: 6-7 per label
    return s.images, s.labels


def _reconstructions(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reads of pool images 0-5: near copies, heavy noise, and blends with another image of the
    same label (some identify their image, some do not)."""
    g = torch.Generator().manual_seed(0)
    idx = torch.arange(6)
    noise = torch.tensor([0.02, 0.3, 0.5, 0.02, 0.4, 0.6]).view(-1, 1, 1, 1)
    other = images[idx + 3]  # the next image of the same label
    mix = torch.tensor([0.0, 0.3, 0.6, 0.5, 0.55, 0.0]).view(-1, 1, 1, 1)
    rec = (1 - mix) * images[idx] + mix * other + noise * torch.randn(images[idx].shape, generator=g)
    return rec.clamp(0, 1), idx


@pytest.mark.parametrize("distance", ["pixel", "lpips", "self"])
def test_iip_is_breachings(pool, distance: str, alexnet_features) -> None:
    images, labels = pool
    rec, idx = _reconstructions(images, labels)
    kwargs, breaching_kw = {}, {}
    if distance == "self":
        model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", depth=2, num_classes=3).eval()
        kwargs["features"] = head_features(model, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # breaching feeds images as they are
        breaching_kw["model"] = model
    if distance == "lpips":
        lp = metrics.get_lpips_model("cpu", backbone_path=alexnet_features)
        kwargs["lpips_model"] = lp
        # breaching's LPIPS score through the same distance: [0, 1] images scaled as LPIPS expects
        breaching_kw["lpips_scorer"] = lambda a, b, normalize=False: metrics.lpips(a[None], b[None], model=lp)
    hit, counts = identified(rec, images[idx], images, labels=labels[idx], pool_labels=labels,
                             distance=distance, **kwargs)
    theirs = image_identifiability_precision({"data": rec}, {"data": images[idx], "labels": labels[idx]},
                                             torch.utils.data.DataLoader(_Pool(images, labels)),
                                             scores=[distance], **breaching_kw)
    assert float(hit.float().mean()) == pytest.approx(theirs[distance])
    assert counts.tolist() == [int((labels == labels[i]).sum()) for i in idx]
    assert 0 < int(hit.sum()) < len(hit), "the case must hold hits and misses to tell rules apart"


def test_iip_pool_without_labels_and_errors(pool) -> None:
    images, labels = pool
    hit, counts = identified(images[:4], images[:4], images)
    assert hit.all() and (counts == len(images)).all()  # exact copies identify their images
    # a true image the pool lacks is never identified
    hit, _ = identified(images[:2], images[:2], images[2:])
    assert not hit.any()
    with pytest.raises(ValueError, match="IIP distance 'ssim'"):
        identified(images[:1], images[:1], images, distance="ssim")
    with pytest.raises(ValueError, match="both labels and pool_labels"):
        identified(images[:1], images[:1], images, labels=labels[:1])
    with pytest.raises(ValueError, match="features"):
        identified(images[:1], images[:1], images, distance="self")


def test_a_run_scores_iip_against_its_image_set_and_registered_psnr(tmp_path) -> None:
    """A real in-process run: rows of (a) and (c) carry IIP against the run's 8 images (4 per label),
    (b) none; registered PSNR is at least PSNR; the table shows both with the chance level."""
    import pandas as pd
    import yaml

    from benchmark.store import read_jsonl
    from run_benchmark import main

    cfg = {
        "name": "iip", "seed": 0, "device": "cpu", "settings": ["a", "b", "c"], "gamma": 0.27,
        "data": {"source": "embedded", "image_size": 32, "num_images": 8, "num_classes": 2},
        "federation": {"engine": "inprocess", "rounds": 1, "clients": 2, "precision": "float64"},
        "models": [{"name": "DeiT+MJP", "arch": "mjp_vit_cifar_patch4_32", "variant": "mjp",
                    "kwargs": {"depth": 2}, "april": "surgery"}],
        "attacks": [{"name": "april_analytic"}],
        "metrics": {"lpips_backbone": None, "rpsnr": True, "iip": ["pixel"]},
        "report": {"grid_images": 0, "tile": 32},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    assert main(["--config", str(path), "--output", str(out), "--no-progress"]) == 0
    rows = pd.DataFrame(read_jsonl(out / "results.jsonl"))
    ok = rows[~rows["failed"]]
    assert len(ok) == 3 * 2  # settings x the two clients' images of round 1
    assert (ok["psnr_registered"].astype(float) >= ok["psnr"].astype(float) - 1e-6).all()
    for setting, g in ok.groupby("setting"):
        if setting == "b":  # the image set holds x, not x~: no candidates to identify against
            assert "iip_pixel" not in g or g["iip_pixel"].isna().all()
            continue
        assert (g["iip_candidates"] == 4).all()  # 8 images, labels index % 2
        assert g["iip_pixel"].isin([0.0, 1.0]).all()
    # APRIL's closed form reads x exactly in (a): every image identified
    assert (ok[ok["setting"] == "a"]["iip_pixel"] == 1.0).all()
    md = (out / "table.md").read_text()
    assert "IIP ↓ (chance)" in md and "rPSNR" in md and "1.00 (0.25)" in md
