"""The bench scripts on tiny inputs (the timings themselves are the scripts' job): every script in
bench/ runs its ``main()`` end to end on its smallest arguments, the vmap route gives the clients'
gradients, and the parts of the benchmark's work run on a tiny config and cover every update."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from helpers import tiny_config

from benchmark.validation import validate

ROOT = Path(__file__).resolve().parents[1]

#: Each bench script's smallest arguments. ``{imagenet}``, ``{cifar}``, ``{data}``, ``{lpips}`` name
#: the team's data sets (the test skips where they are missing), ``{tmp}`` a fresh folder. A script
#: in bench/ that is neither here nor in SKIPPED fails test_every_bench_is_listed.
SMALLEST: dict[str, list[str]] = {
    "attack_throughput": ["--data", "{imagenet}", "--april-images", "1", "--april-depth", "1", "--batch", "1",
                          "--ig-iterations", "1", "--ig-depth", "1", "--ig-dim", "48", "--repeats", "1",
                          "--mjp-images", "1", "--closed-images", "1", "--closed-sizes", "32"],
    "attention_entropy": ["--checkpoint", str(ROOT / "checkpoints" / "cifar_deit.safetensors"),
                          "--data-path", "{cifar}", "--images", "2", "--out", "{tmp}/rows.json"],
    "batch_match_basin": ["--data", "{imagenet}", "--noise", "0.1", "--iterations", "1", "--attack-iterations", "1"],
    "batch_labels": ["--data", "{cifar}", "--batch-sizes", "2", "--updates", "1", "--pool", "4", "--starts", "2",
                     "--iterations", "5", "--image-starts", "2", "--models", "cifar_deit:plain"],
    "benchmark_overhead": ["--config", str(ROOT / "configs" / "default.yaml"), "--num-images", "1",
                           "--setting", "a", "--parts", "--set", "attacks=[{name: pe_closed_form}]",
                           "--set", "models=[{name: DeiT, arch: mjp_vit_cifar_patch4_32, kwargs: {depth: 1}, "
                           "variant: plain, april: surgery, checkpoint: null}]"],
    "block_solve": ["--size", "32", "--patch", "4", "--width", "192", "--calls", "1"],
    "block0_roots": ["--images", "embedded", "--batch-sizes", "1", "--updates", "1", "--pool", "2", "--starts", "2",
                     "--rounds", "1", "--match-iterations", "1"],
    "closed_forms": ["--data", "{imagenet}", "--images", "1", "--defences", "none", "--priors", "smooth",
                     "--sections", "designA"],
    "codec_throughput": ["--arch", "mjp_vit_cifar_patch4_32", "--repeats", "1"],
    "fl_overhead": ["--clients", "1", "--rounds", "1", "--skip-inprocess", "--num-cpus", "1",
                    "-c", "model-kwargs='{\"depth\": 1}'", "--json", "{tmp}/fl.json"],
    "metrics_throughput": ["--data", "{data}", "--backbone", "{lpips}", "--pairs", "2", "--unique", "1",
                           "--size", "32", "--threads", "1", "--lpips-batch", "2", "--repeats", "1",
                           "--warmup", "1"],
    "defence_curves": ["--images", "embedded", "--num-images", "1", "--bits", "8", "--keep", "0.1", "--sigma", "1e-4,1",
                       "--prior-images", "8",
                       "--plot", "{tmp}/curves.png"],
    "likelihood_match": ["--images", "embedded", "--num-images", "1", "--iterations", "1", "--cg-iterations", "2"],
    "jigsaw_bound": ["--images", "embedded", "--num-images", "1", "--costs", "l2"],
    "mjp_adaptive_strength": ["--num-images", "1", "--weights", "fresh", "--depth", "1", "--attacks", "april"],
    "mjp_overhead": ["--batch", "1", "--repeats", "1", "--steps", "1", "--warmup", "0"],
    "roots_floor": ["--images", "embedded", "--num-images", "1", "--iterations", "2", "--precisions", "float64",
                    "--search-rounds", "1", "--defences", "[{name: quantize, bits: 12}]"],
    "train_throughput": ["--embed-dim", "48", "--depth", "1", "--heads", "1", "--batch-size", "2", "--steps", "1",
                         "--rounds", "1", "--no-aug", "--device", "cpu", "--amp", "none"],
    "vmap_victims": ["--arch", "mjp_vit_cifar_patch4_32", "--clients", "2", "--repeats", "1",
                     "--images", "embedded"],
}
#: Scripts whose main() the tests do not run, with the reason.
SKIPPED: dict[str, str] = {"gpu_check": "tests/test_gpu_check.py runs its main() with --device cpu --quick"}
#: Scripts whose smallest run still takes more than a few seconds (marked slow).
SLOW = {"attack_throughput", "benchmark_overhead", "fl_overhead"}
#: The data sets behind the placeholders of SMALLEST.
PLACEHOLDERS = {"{imagenet}": "imagenet-sample", "{cifar}": "cifar10.tar.gz",
                "{lpips}": "lpips/alexnet_features.pth"}
BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("*.py"))


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_bench_is_listed() -> None:
    unlisted = [b for b in BENCHES if b not in SMALLEST and b not in SKIPPED]
    assert not unlisted, f"add the smallest arguments of bench/{unlisted[0]}.py to SMALLEST (or a reason to SKIPPED)"
    assert not (set(SMALLEST) | set(SKIPPED)) - set(BENCHES), "SMALLEST/SKIPPED name a script that is not in bench/"


@pytest.mark.parametrize("name", [pytest.param(b, marks=[pytest.mark.slow] if b in SLOW else [])
                                  for b in BENCHES if b not in SKIPPED])
def test_bench_main_runs_on_its_smallest_arguments(name: str, team_data, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    argv = []
    for arg in SMALLEST[name]:
        for mark, dataset in PLACEHOLDERS.items():
            if mark in arg:
                arg = arg.replace(mark, str(team_data.path(dataset)))
        if "{data}" in arg:
            arg = arg.replace("{data}", str(team_data.path("imagenet-sample").parent))
        argv.append(arg.replace("{tmp}", str(tmp_path)))
    caplog.set_level("INFO")
    code = load_bench(name).main(argv)
    assert code in (None, 0)
    assert capsys.readouterr().out or caplog.text, "the bench reported nothing"


@pytest.mark.parametrize("variant,setting", [("plain", "a"), ("mjp", "b")])
def test_vmap_gradients_equal_the_clients_loop(variant: str, setting: str) -> None:
    from clients.partition import private_batch
    from clients.runconfig import resolve_config
    from clients.update import fedsgd_gradients, load_global_model

    bench = load_bench("vmap_victims")
    cfg = resolve_config({"model-arch": "mjp_vit_cifar_patch4_32", "model-variant": variant,
                          "model-kwargs": {"depth": 2}, "model-april": "surgery", "images": "embedded",
                          "num-images": 3, "num-partitions": 3, "setting": setting, "device": "cpu"})
    model = load_global_model(cfg)
    batches = [private_batch(cfg, c, 1, 3) for c in range(3)]
    assert (batches[0].unk_mask is not None) == (variant == "mjp")
    for fused in (True, False):
        bench.set_fused(model, fused)
        got = bench.vmap_gradients(model, batches)
        bench.set_fused(model, True)
        for c, batch in enumerate(batches):
            want = fedsgd_gradients(model, batch)[0]
            assert got.keys() == want.keys()
            scale = max(float(g.abs().max()) for g in want.values())
            for k in want:  # float32: summation order only
                assert float((got[k][c] - want[k]).abs().max()) <= 1e-5 * scale, (k, fused)


def test_parts_of_the_benchmark_cover_every_update() -> None:
    bench = load_bench("benchmark_overhead")
    cfg = validate(tiny_config(settings=["a", "b", "c"]))
    parts, n = bench.bare_parts(cfg, bench.bare_work(cfg))
    assert n == 2 * 2 * 2 * 2  # models x groups x rounds x clients
    assert set(parts) == {"victim gradients", "Acc. forward", "attack", "metrics"}
    assert all(v > 0 for v in parts.values())


@pytest.mark.slow
def test_mjp_adaptive_strength_roots_mode_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/mjp_adaptive_strength.py --roots (block 0's per-token MLP roots and the fit to them) on
    its smallest arguments: one fresh depth-1 model, 8 starts, one LM Jacobian per placement."""
    load_bench("mjp_adaptive_strength").main(["--num-images", "1", "--weights", "fresh", "--depth", "1",
                                              "--roots", "8", "--roots-jacobians", "1"])
    out = capsys.readouterr().out
    assert "roots: 8 starts" in out
    assert "fit to the roots at their assigned positions" in out and "fit to the roots at their oracle positions" in out


@pytest.mark.slow
def test_mjp_adaptive_strength_gn_step_and_matrix_free_basin_run(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/mjp_adaptive_strength.py --gn-step (dense against sketch-preconditioned CG) and the basin
    test with --basin-solver matrix_free, on one fresh depth-1 model; a bad sketch size is refused."""
    bench = load_bench("mjp_adaptive_strength")
    bench.main(["--num-images", "1", "--weights", "fresh", "--depth", "1", "--gn-step", "0.5"])
    out = capsys.readouterr().out
    assert "dense step" in out and "sketch m =   512 (0.5 n)" in out
    bench.main(["--num-images", "1", "--weights", "fresh", "--depth", "1", "--basin", "0.05",
                "--basin-solver", "matrix_free", "--basin-jacobians", "1"])
    assert "eps 0.05 (matrix_free)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--num-images", "1", "--weights", "fresh", "--depth", "1", "--gn-step", "0,9"])
    assert "from 0 to 4" in capsys.readouterr().err


def test_block0_roots_membership_mode_tells_the_assignments_apart() -> None:
    """bench/block0_roots.py --membership on its smallest batch (B = 2, bundled photographs, 10 fit
    steps): the fit to the roots at their true image and position is far ahead of the one that
    assigns them itself (measured 33.9 against 11.0 dB)."""
    import timm
    import torch

    import fedmjp  # noqa: F401  (registers the models)
    from fedmjp.checkpoint import load_checkpoint
    from helpers import MEAN, STD, bundled_images

    bench = load_bench("block0_roots")

    torch.manual_seed(0)
    model = timm.create_model("mjp_vit_cifar_patch4_32", variant="plain", first_block="standard", depth=4)
    load_checkpoint(model, ROOT / "checkpoints" / "cifar_deit.safetensors")
    model = model.eval().double()
    out = bench.membership(model, bundled_images(2, 32, 0), MEAN.double(), STD.double(), 10,
                           torch.Generator().manual_seed(0))
    assert out["true"] > 25.0 and out["self-assigned"] < 20.0
    with pytest.raises(SystemExit):
        bench.main(["--images", "embedded", "--pool", "2", "--membership", "3"])


@pytest.mark.slow
def test_block0_roots_past_floor_mode_reads_true_roots_at_b3(caplog: pytest.LogCaptureFixture) -> None:
    """bench/block0_roots.py --past-floor on its smallest run (B = 3 bundled photographs, 16 starts
    for the near-roots, one search round of 8): fc2's span completed to the rounding floor and
    every root found a true token; a B within the floor is refused."""
    bench = load_bench("block0_roots")
    caplog.set_level("INFO")
    bench.main(["--images", "embedded", "--pool", "3", "--past-floor", "3", "--updates", "1", "--starts", "8",
                "--rounds", "1"])
    m = re.search(r"fc2's span rank 191 of 195 tokens, completed from (\d+) near-roots \(near (\d+) distinct true "
                  r"tokens\) to a residual of (\S+) \(their largest 1 - cos to a true token (\S+)\); roots found "
                  r"(\d+) of 195, (\d+) true tokens", caplog.text)
    assert m, caplog.text[-3000:]
    assert int(m[1]) > 4 and 1 <= int(m[2]) <= int(m[1]) and float(m[3]) < 1e-20 and float(m[4]) < 1e-12
    assert int(m[5]) == int(m[6]) >= 3
    with pytest.raises(SystemExit):
        bench.main(["--images", "embedded", "--pool", "2", "--past-floor", "2"])
    # B = 4 (k = 69): the failed row says how many true tokens the near-roots reach and how many the
    # fit needs (111 at k = 69 on this geometry), beside the completion's own refusal; --oracle counts the
    # tokens whose own start ends next to them (the most any search for near-roots reaches)
    caplog.clear()
    bench.main(["--images", "embedded", "--pool", "4", "--past-floor", "4", "--updates", "1", "--starts", "4",
                "--oracle", "8"])
    m = re.search(r"B=4 update 0: (\d+) near-roots, near (\d+) distinct true tokens .*k = 69 missing dimensions, "
                  r"the fit needs at least 111 true tokens\); failed: completing fc2's span by 69", caplog.text)
    assert m, caplog.text[-3000:]
    assert int(m[2]) <= int(m[1]) <= 8
    m = re.search(r"B=4 update 0: near-roots from the true tokens: (\d+) of 8 true tokens' own starts end within "
                  r"1e-02 of them \(median 1 - cos (\S+); about (\d+) of 260 tokens", caplog.text)
    assert m, caplog.text[-3000:]
    assert int(m[3]) == round(int(m[1]) * 260 / 8) and 0 < float(m[2]) < 1
    with pytest.raises(SystemExit):
        bench.main(["--images", "embedded", "--pool", "4", "--oracle", "8"])


@pytest.mark.slow
def test_block0_roots_design_a_mode_prints_a_row_per_photograph(caplog: pytest.LogCaptureFixture) -> None:
    """bench/block0_roots.py --design-a on its smallest run (one bundled photograph, one attention
    iteration and no structured solve, so the read fails at the attention solve, the row naming why;
    a full read takes minutes, docs/results/structure.md), and its bad arguments."""
    bench = load_bench("block0_roots")
    caplog.set_level("INFO")
    bench.main(["--images", "embedded", "--pool", "1", "--design-a", "1", "--attention-iterations", "1",
                "--attention-starts", "1", "--structured-rounds", "0"])
    assert re.search(r"design A, image 0: failed: design A: the attention solve ended at a squared residual of "
                     r"\S+ after 1 starts of 1 iterations", caplog.text), caplog.text
    assert "design A: 0 of 1 images read exactly" in caplog.text
    for bad in (["--design-a", "2"], ["--design-a", "1", "--first", "1"],
                ["--design-a", "1", "--attention-starts", "0"],
                ["--design-a", "1", "--attention-iterations", "1001"],
                ["--design-a", "1", "--structured-rounds", "-1"],
                ["--design-a", "1", "--span-polish", "101"]):
        with pytest.raises(SystemExit):
            bench.main(["--images", "embedded", "--pool", "1", *bad])
