"""The GPU path, checked in one command: every part timed on ``--device`` and checked against the CPU.

Parts (each with its own time budget; a part that fails or runs over is recorded with its error and
the next one runs; ``gpu_check.json`` and ``gpu_check.md`` in ``--out`` are rewritten after every
part, so a run stopped by a timeout still leaves the parts it finished):

- ``env``: device, card, library versions, CPU count.
- ``pytest_cuda``: ``python -m pytest -m cuda`` on the test files that carry the marker, as a subprocess,
  its summary line.
- ``closed_forms``: ``pe_closed_form`` and ``april_analytic`` per image at 224 px (DeiT-S/16, design
  A), float64 and float32 clients, a plain and an MJP-shuffled update; the victim gradient computed
  on the device and on the CPU (same weights, same input), and the attack run on both copies of the
  same update.
- ``april_robust``: on an 8-bit quantised update, ``device=`` the device; the CPU reference at 32 px,
  the timing at 224 px.
- ``mjp_adaptive``: ``refine=span`` with an explicit ``span_iterations`` (its default budget skips
  the fit at 224 px) on an MJP-shuffled update; CPU reference at 32 px.
- ``ig_closed_start``: seconds per step and to convergence on one 224 px image (8-bit quantised, its
  start ``pe_closed_form``), ``device=`` the device; CPU reference: 10 steps at 32 px.
- ``metrics``: LPIPS and SSIM pairs per second, device against CPU values on the same pairs (LPIPS
  on a seeded random AlexNet trunk where no trained weights are found, recorded as such).
- ``train_deit_s``, ``train_cifar``: central training images/s (configs/train/deit_s_mjp.yaml at
  224 px with bf16 autocast, configs/train/cifar_deit_mjp.yaml as the recipe sets it); the float32
  loss of one batch on the device against the CPU.
- ``preset_default``, ``preset_cifar``: ``run_benchmark.py --device DEV`` end to end (the run's
  device reaches every attacker with a ``device`` option: ``april_robust``, ``ig_closed_start``; the CIFAR
  preset on its two shipped checkpoints, ``ig_closed_start`` capped); the same run on the CPU, its
  per-row PSNR compared. ``--quick``: two rows, two images on two clients, every attacker at its
  cheapest options, the CIFAR preset on the bundled images where the archive is missing.
- ``span_lm``: the span fit's matrix-free Levenberg-Marquardt stage (:func:`attacks.solvers.lm.matrix_free_lm`)
  at 224 px from the truth plus 0.05 noise (seeded DeiT-S weights): residual and x~'s PSNR per
  iteration, seconds, CG iterations; the 32 px reference on the device and the CPU, same residual.
- ``projection``: the paper preset (configs/paper.yaml: 999 images, settings a/b/c) per attacker on
  one device from the measured per-image figures, and the plan for several GPUs.

A CUDA result passes its check when it equals the CPU result within the precision's noise: a
reconstruction's PSNR against the CPU's reconstruction is at least the lower of the two PSNRs
against the truth minus 4 dB (two independent rounding errors of the same size cost 3 dB), or at
least 60 dB for the regularised and optimised attacks, whose results are not exact.

    bash scripts/setup.sh && python bench/gpu_check.py --out runs/gpu_check     # on a GPU (~5-6 min)
    python bench/gpu_check.py --device cpu --quick --out /tmp/gpu_check           # every part, tiny sizes
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import attacks  # noqa: E402
import fedmjp  # noqa: E402,F401  (registers the mjp_* models)
from fedmjp.devices import resolve_device  # noqa: E402
from fedmjp.factory import normalize  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
#: Paper preset (configs/paper.yaml): rows, groups of updates per row (a: x; b/c: the shuffled x~,
#: one gradient scored twice), images. 5 x 2 x 999 = 9,990 updates.
PAPER_ROWS, PAPER_GROUPS, PAPER_IMAGES = 5, 2, 999
#: Rows of the paper preset with E_unk (DeiT-S+MJP): mjp_adaptive does its full work on their
#: shuffled group only; elsewhere it is the closed form.
PAPER_MJP_ROWS = 1
AIM_CLOSED_ROBUST_MJP_S = 3600.0  # closed forms + april_robust + mjp_adaptive over the preset, one GPU
AIM_IG_CONVERGED_S = 60.0  # a converged ig_closed_start per 224 px image


class PartTimeout(Exception):
    """A part ran past its budget."""


class PartLost(Exception):
    """A part that needs this process's CUDA context after an earlier part lost it."""


#: Parts that need no CUDA context of this process: they run their own processes, or none on the device.
OWN_PROCESS_PARTS = {"env", "pytest_cuda", "projection", "preset_default", "preset_cifar"}


def context_lost(err: BaseException) -> bool:
    """A CUDA error after which every later CUDA call of this process fails (a device-side assert,
    an illegal address): the remaining in-process parts are not run, not reported as their own errors."""
    text = f"{type(err).__name__}: {err}"
    return type(err).__name__ == "AcceleratorError" or any(
        s in text for s in ("device-side assert", "illegal memory access", "unspecified launch failure"))


class PartSkipped(Exception):
    """A part cannot run here (its data is missing); recorded as ``skipped`` with the reason."""


@dataclass
class Context:
    """What every part reads: the device, sizes and the budget scale."""

    device: torch.device
    quick: bool
    out: Path
    data: Optional[Path]
    results: dict[str, Any] = field(default_factory=dict)
    #: the part in which this process's CUDA context was lost (later in-process parts are not run)
    lost: Optional[str] = None
    #: what a part has measured so far (kept in the report when the part then fails or runs over)
    partial: dict[str, dict] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def size(self) -> int:
        """The timing size: 224 px (DeiT-S/16), 32 px with ``--quick``."""
        return 32 if self.quick else 224

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


# ------------------------------------------------------------------------------------ helpers
@contextmanager
def budget(seconds: float) -> Iterator[None]:
    """Raise :class:`PartTimeout` in this (main) thread after ``seconds`` of wall time."""
    def fire(signum: int, frame: Any) -> None:
        raise PartTimeout(f"over its budget of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two [.., H, W] images in [0, 1] (compared in float64 on the CPU; 300 dB cap)."""
    mse = float((a.detach().double().cpu() - b.detach().double().cpu()).pow(2).mean())
    return 10 * math.log10(1.0 / max(mse, 1e-30))


def agrees(p_dev: float, p_cpu: float, mutual: float, exact: bool) -> bool:
    """The device's reconstruction equals the CPU's within the precision's noise (module docstring)."""
    if exact:
        return mutual >= min(p_dev, p_cpu) - 4.0
    return mutual >= min(60.0, min(p_dev, p_cpu) + 20.0) or mutual >= min(p_dev, p_cpu) - 4.0


def test_images(ctx: Context, n: int, size: int) -> torch.Tensor:
    """[n, 3, size, size] in [0, 1]: ImageNet-sample JPEGs where ``FEDMJP_DATA`` has them, else
    scikit-image's bundled photographs."""
    from fedmjp.data import load_embedded, load_folder

    if ctx.data is not None and (ctx.data / "imagenet-sample").is_dir():
        return load_folder(ctx.data / "imagenet-sample", size, num_images=n).images[:n]
    return load_embedded(size, n).images[:n]


def vit(ctx: Context, size: int, variant: str, dtype: torch.dtype) -> torch.nn.Module:
    """A seeded design-A ViT on the CPU: DeiT-S/16 at 224 px, the presets' CIFAR model (depth 2) at 32.
    Depth 2 is the least at which the closed forms are exact: with block 0 the last block, only its
    class token reaches the head, and the patch tokens' gradients do not determine the image."""
    import timm

    torch.manual_seed(0)
    arch, kwargs = (("mjp_deit_small_patch16_224", {}) if size == 224
                    else ("mjp_vit_cifar_patch4_32", {"depth": 2}))
    return timm.create_model(arch, variant=variant, first_block="april", **kwargs).eval().to(dtype)


@dataclass
class Case:
    """One client update, computed on the device and on the CPU from the same weights and input."""

    model_dev: torch.nn.Module
    model_cpu: torch.nn.Module
    update_dev: dict
    update_cpu: dict
    meta: dict
    truth: torch.Tensor
    grad_rel_diff: float


def make_case(ctx: Context, size: int, variant: str, dtype: torch.dtype, quantize: Optional[int] = None,
              index: int = 0) -> Case:
    """The update of image ``index`` (x~ with gamma 0.27 for the MJP variant) on both devices;
    ``quantize``: the clients' 8-bit quantisation applied to both."""
    from defences import quantize_update

    model_cpu = vit(ctx, size, variant, dtype)
    model_dev = copy.deepcopy(model_cpu).to(ctx.device)
    x = test_images(ctx, index + 1, size)[index:index + 1].to(dtype)
    y = torch.tensor([index % model_cpu.num_classes])
    mask = None
    if variant == "mjp":
        plan = model_cpu.draw_plan(1, gamma=0.27, seed=100 + index)
        x = model_cpu.shuffle_images(x, plan)
        mask = plan.mask
    inp = normalize(x, MEAN, STD)
    upd_cpu = attacks.compute_update(model_cpu, inp, y, unk_mask=mask)
    upd_dev = attacks.compute_update(model_dev, inp.to(ctx.device), y.to(ctx.device),
                                     unk_mask=None if mask is None else mask.to(ctx.device))
    scale = max(float(g.abs().max()) for g in upd_cpu.values())
    rel = max(float((upd_dev[k].cpu() - upd_cpu[k]).abs().max()) for k in upd_cpu) / max(scale, 1e-300)
    meta: dict[str, Any] = dict(mean=MEAN, std=STD, num_images=1, image_size=(3, size, size), labels=y)
    if quantize:
        upd_cpu = quantize_update(upd_cpu, quantize)
        upd_dev = {k: v.to(ctx.device) for k, v in upd_cpu.items()}  # the same received update on both
        meta["defence"] = {"name": "quantize", "bits": quantize, "stochastic": False}
    else:
        # the attack runs on both copies of the device's update: its own device path, same input
        upd_cpu = {k: v.cpu() for k, v in upd_dev.items()}
    return Case(model_dev, model_cpu, upd_dev, upd_cpu, meta, x.float(), rel)


def run_attack(ctx: Context, name: str, options: dict, model: torch.nn.Module, update: dict,
               meta: dict) -> tuple[Any, float]:
    """(result, wall seconds) of one attack on one update, the device synchronised around it."""
    attack = attacks.create_attack(name, **options)
    ctx.sync()
    t0 = time.perf_counter()
    result = attack.reconstruct(model, update, dict(meta))
    ctx.sync()
    dt = time.perf_counter() - t0
    if result.failed:
        raise RuntimeError(f"{name} failed: {result.reason}")
    return result, dt


def estimate(result: Any) -> torch.Tensor:
    """The attack's estimate of x (its unshuffled image where it solves the jigsaw)."""
    return result.unshuffled if getattr(result, "unshuffled", None) is not None else result.images


def compare_attack(ctx: Context, case: Case, name: str, options: dict, exact: bool,
                   dev_options: Optional[dict] = None) -> dict:
    """The attack on the device's and the CPU's copy of the same update: times, PSNRs, agreement."""
    res_dev, t_dev = run_attack(ctx, name, {**options, **(dev_options or {})}, case.model_dev, case.update_dev,
                                case.meta)
    res_cpu, t_cpu = run_attack(ctx, name, options, case.model_cpu, case.update_cpu, case.meta)
    p_dev, p_cpu = psnr(estimate(res_dev), case.truth), psnr(estimate(res_cpu), case.truth)
    mutual = psnr(estimate(res_dev), estimate(res_cpu))
    return dict(attack=name, s_device=round(t_dev, 4), s_cpu=round(t_cpu, 4), psnr_device=round(p_dev, 2),
                psnr_cpu=round(p_cpu, 2), psnr_device_vs_cpu=round(mutual, 2),
                agrees=agrees(p_dev, p_cpu, mutual, exact))


def where_it_computes(name: str, options: dict) -> str:
    """Where an attack's arithmetic runs, from its options (the closed forms pin theirs to the CPU)."""
    if "device" in options:
        return str(options["device"])
    return "cpu (the attack moves the update to the CPU, float64)"


# ------------------------------------------------------------------------------------ parts
def part_env(ctx: Context) -> dict:
    import flwr
    import numpy
    import timm

    out: dict[str, Any] = dict(device=str(ctx.device), python=platform.python_version(), torch=torch.__version__,
                               torch_cuda=torch.version.cuda, timm=timm.__version__, flwr=flwr.__version__,
                               numpy=numpy.__version__, cpus=os.cpu_count(), torch_threads=torch.get_num_threads(),
                               platform=platform.platform(), cpu=platform.processor() or platform.machine(),
                               quick=ctx.quick, cuda_available=torch.cuda.is_available())
    if ctx.cuda:
        prop = torch.cuda.get_device_properties(ctx.device)
        out.update(card=prop.name, memory_gib=round(prop.total_memory / 2 ** 30, 1),
                   capability=f"{prop.major}.{prop.minor}", cudnn=torch.backends.cudnn.version(),
                   bf16=torch.cuda.is_bf16_supported(),
                   tf32_matmul=torch.backends.cuda.matmul.allow_tf32, tf32_cudnn=torch.backends.cudnn.allow_tf32)
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
        # tracked files that differ from that commit: the figures are not that commit's
        changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, capture_output=True, timeout=10)
        if out["commit"] and changed.returncode == 1:
            out["commit"] += " with local changes"
    except (OSError, subprocess.SubprocessError):
        out["commit"] = None
    out["checks"] = {"device resolved": ctx.device.type in ("cpu", "cuda")}
    return out


def part_pytest_cuda(ctx: Context, seconds: float) -> dict:
    # the test files that carry the cuda marker (collecting the whole suite would also need every
    # test-only dependency on the GPU machine, for tests that are deselected anyway)
    target = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                    if "mark.cuda" in p.read_text(encoding="utf-8"))
    if not target:
        raise PartSkipped("no test file carries the cuda marker")
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "-rfEs", "--tb=line",
           *target]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=seconds)
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    summary = lines[-1] if lines else proc.stderr.strip()[-300:]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error|errors)", summary)}
    # pytest's exit status 5 is "no tests ran" (every cuda test deselected): not a failure of the code
    ok = proc.returncode == 0 or (proc.returncode == 5 and not counts.get("failed"))
    if ctx.cuda and not counts.get("passed"):
        ok = False  # on a GPU the cuda tests must run, not skip
    failures = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))][:10]
    return dict(command=" ".join(cmd[1:]), exit_status=proc.returncode, summary=summary, counts=counts,
                failures=failures, checks={"cuda tests pass": ok})


def part_closed_forms(ctx: Context) -> dict:
    rows, checks = [], {}
    for dtype in (torch.float64, torch.float32):
        for variant in ("plain", "mjp"):
            case = make_case(ctx, ctx.size, variant, dtype)
            tag = f"{str(dtype)[6:]} clients, {'MJP shuffled' if variant == 'mjp' else 'plain'}"
            for name in ("pe_closed_form", "april_analytic"):
                run_attack(ctx, name, {}, case.model_dev, case.update_dev, case.meta)  # warm-up (SVD cache)
                row = compare_attack(ctx, case, name, {}, exact=True)
                row.update(update=tag, victim_grad_rel_diff=float(f"{case.grad_rel_diff:.3g}"),
                           computes_on=where_it_computes(name, {}))
                rows.append(row)
                checks[f"{name}, {tag}: device = CPU"] = row["agrees"]
            # float64: summation order only; float32: float32 rounding (TF32 convolutions would exceed it)
            checks[f"victim gradient {tag}: device = CPU"] = case.grad_rel_diff <= (1e-9 if dtype == torch.float64
                                                                                   else 1e-4)
    return dict(size=ctx.size, rows=rows, checks=checks)


def part_april_robust(ctx: Context, seconds: float) -> dict:
    # at 224 px one alternation is ~10^2 CG steps over 150k unknowns (docs/results/attacks.md): 4 alternations
    # the whole solve (float64) on the device: ``device=`` the device, the CPU reference ``device=cpu``
    dev = str(ctx.device)
    small = dict(iterations=1, cg_maxiter=20) if ctx.quick else {}
    opts224 = dict(iterations=4, cg_tol=1e-8, cg_maxiter=200) if ctx.size == 224 else small
    ref = compare_attack(ctx, make_case(ctx, 32, "plain", torch.float64, quantize=8), "april_robust",
                         {**small, "device": "cpu"}, exact=False, dev_options={"device": dev})
    case = make_case(ctx, ctx.size, "plain", torch.float64, quantize=8)
    opts224 = {**opts224, "device": dev}
    res, dt = run_attack(ctx, "april_robust", opts224, case.model_dev, case.update_dev, case.meta)
    stats = res.stats[0]
    return dict(reference_32px=ref, size=ctx.size, options=opts224, s_per_image=round(dt, 3),
                psnr=round(psnr(estimate(res), case.truth), 2), cg_iterations=stats.get("cg_iterations"),
                alternations=stats.get("iterations"), computes_on=where_it_computes("april_robust", opts224),
                checks={"april_robust 32 px: device = CPU": ref["agrees"]})


def part_mjp_adaptive(ctx: Context, seconds: float) -> dict:
    # run_attack passes no estimate store (attacks.api.estimates): every run computes its own x~
    # --quick: no TV refinement of the prior's start (300 L-BFGS steps, most of a 32 px call's time);
    # the span fit, its probe of two starts and the jigsaw still run
    cheap = dict(tv_prior=False) if ctx.quick else {}
    small = dict(refine="span", span_iterations=2 if ctx.quick else 20, starts=2, probe_iterations=1 if ctx.quick else 5,
                 **cheap)
    dev = str(ctx.device)
    ref = compare_attack(ctx, make_case(ctx, 32, "mjp", torch.float64), "mjp_adaptive", {**small, "device": "cpu"},
                         exact=False, dev_options={"device": dev, "min_device_cost": 0})
    opts = (dict(refine="span", span_iterations=2, starts=2, probe_iterations=1, **cheap) if ctx.quick
            else dict(refine="span", span_iterations=150, starts=2, probe_iterations=10))
    opts["device"] = dev
    # the prior's estimate alone, for the span fit's share of the time
    case = make_case(ctx, ctx.size, "mjp", torch.float64)
    res, dt = run_attack(ctx, "mjp_adaptive", opts, case.model_dev, case.update_dev, case.meta)
    prior, dt_prior = run_attack(ctx, "mjp_adaptive", dict(refine="prior", device=dev, **cheap),
                                 case.model_dev,
                                 case.update_dev, case.meta)
    st = res.stats[0]
    return dict(reference_32px=ref, size=ctx.size, options=opts, s_per_image=round(dt, 3),
                psnr_c=round(psnr(estimate(res), case.truth), 2), span_note=st.get("span_note"),
                span_iterations_run=st.get("iterations"), s_prior_only=round(dt_prior, 3),
                psnr_c_prior_only=round(psnr(estimate(prior), case.truth), 2),
                computes_on=where_it_computes("mjp_adaptive", opts),
                checks={"mjp_adaptive 32 px: device = CPU": ref["agrees"],
                        "span fit ran": st.get("span_note") is None})


def _span_lm_run(ctx: Context, size: int, device: torch.device, options: dict, partial: Optional[dict] = None) -> dict:
    """Matrix-free Levenberg-Marquardt on the span residual of a design-A MJP update (float64), from
    the truth's reduced parameters plus 0.05 x their spread of seeded noise: residual and x~'s PSNR
    before and after, per-iteration seconds and CG iterations. ``partial`` gets the figures after
    every iteration (a part stopped by its budget keeps them)."""
    from attacks.solvers.lm import matrix_free_lm
    from attacks.optimization.span_fit import span_problem, truth_coordinates

    case = make_case(ctx, size, "mjp", torch.float64)
    model = case.model_cpu
    S, grads, _ = attacks.create_attack("mjp_adaptive").read_update(model, dict(case.update_cpu))
    prob = span_problem(model, grads, S, device=device)
    red, p = prob.red, prob.patch
    vec = prob.vector()
    xin = normalize(case.truth.double(), MEAN, STD).to(device)
    theta = vec.pack(*truth_coordinates(red, xin, p))
    gen = torch.Generator().manual_seed(0)
    th0 = theta + 0.05 * float(theta.std()) * torch.randn(theta.shape, generator=gen, dtype=theta.dtype).to(device)
    std = torch.tensor(STD, dtype=torch.float64, device=device)[:, None, None]

    def db(t: torch.Tensor) -> float:
        return round(float(-10 * torch.log10(((vec.image(t) - xin) * std).pow(2).mean())), 2)

    out: dict[str, Any] = dict(size=size, unknowns=theta.numel(), rows=int(vec(theta).numel()),
                               shuffled=int(red.shuffled.sum()), options=options, psnr_start=db(th0), iterations=[])
    ctx.sync()
    t_last = [time.perf_counter()]

    def record(i: int, t: torch.Tensor, value: float) -> None:
        ctx.sync()
        now = time.perf_counter()
        out["iterations"].append(dict(residual=float(f"{value:.3e}"), psnr=db(t), s=round(now - t_last[0], 2)))
        t_last[0] = now
        if partial is not None:
            partial.update(out)

    res = matrix_free_lm(vec, th0, callback=record, **options)
    out.update(residual_start=res.value_first, residual=res.value, psnr=db(res.theta),
               cg_iterations=res.cg_iterations, sketch_rows=res.sketch_rows)
    return out


def part_span_lm(ctx: Context, seconds: float) -> dict:
    """The matrix-free second-order stage (attacks.solvers.lm.matrix_free_lm) where the dense Jacobian
    cannot go: at ``ctx.size`` on the device; reference: one iteration at 32 px on the device and the
    CPU, the same residual."""
    small = dict(max_iterations=1, sketch_rows=64, cg_iterations=20 if ctx.quick else 100)
    ref_dev = _span_lm_run(ctx, 32, ctx.device, small)
    ref_cpu = _span_lm_run(ctx, 32, torch.device("cpu"), small)
    agree = abs(ref_dev["residual"] - ref_cpu["residual"]) <= 1e-6 * max(abs(ref_cpu["residual"]), 1e-300)
    opts = small if ctx.quick else dict(max_iterations=3, cg_iterations=300)
    partial = ctx.partial.setdefault("span_lm", {})
    partial["reference_32px"] = dict(residual_device=ref_dev["residual"], residual_cpu=ref_cpu["residual"])
    big = _span_lm_run(ctx, ctx.size, ctx.device, opts, partial)
    return dict(reference_32px=partial["reference_32px"], **big,
                checks={"span_lm 32 px: device = CPU": agree, "residual falls": big["residual"] < big["residual_start"]})


def part_ig_closed_start(ctx: Context, seconds: float) -> dict:
    t_part = time.perf_counter()
    dev = str(ctx.device)
    base = dict(restarts=1, start_attacks=["pe_closed_form"], cuda_graph=False)  # eager steps unless set
    small = make_case(ctx, 32, "plain", torch.float64, quantize=8)
    small.model_dev, small.model_cpu = small.model_dev.float(), small.model_cpu.float()
    ref = compare_attack(ctx, small, "ig_closed_start", {**base, "iterations": 3 if ctx.quick else 10, "device": "cpu"},
                         exact=False,
                         dev_options={"device": dev})
    case = make_case(ctx, ctx.size, "plain", torch.float64, quantize=8)
    case.model_dev = case.model_dev.float()  # the attacker's forward is float32 (attack_copy)
    _, t_start = run_attack(ctx, "pe_closed_form", {}, case.model_dev, case.update_dev, case.meta)
    probe_steps = 2 if ctx.quick else 20
    res, dt = run_attack(ctx, "ig_closed_start", {**base, "iterations": probe_steps, "device": dev,
                                                  "converge_window": probe_steps}, case.model_dev,
                         case.update_dev, case.meta)
    per_step = max(dt - t_start, 0.0) / max(int(res.stats[0].get("iterations", probe_steps)), 1)
    partial = ctx.partial.setdefault("ig_closed_start", {})
    partial.update(reference_32px=ref, size=ctx.size, s_per_step=round(per_step, 4), s_start=round(t_start, 3),
                   projected_s_2000_steps=round(t_start + 2000 * per_step, 1))
    try:  # where a step's time goes (launches or arithmetic): a diagnosis, never a failed part
        step_profile = profile_steps(ctx, case, {**base, "device": dev}, (1, 2) if ctx.quick else (5, 15))
    except Exception as err:  # noqa: BLE001 - the profiler's own failure is recorded, the part goes on
        step_profile = dict(error=f"{type(err).__name__}: {err}"[:300])
    partial["step_profile"] = step_profile
    graph = graph_steps(ctx, case, {**base, "device": dev}, res, (1, 2) if ctx.quick else (10, 40))
    partial["cuda_graph"] = graph
    step = min(per_step, graph.get("s_per_step") or per_step)  # the faster way to step, where it matched
    use_graph = step < per_step
    left = seconds - (time.perf_counter() - t_part)
    cap = 3 if ctx.quick else int(min(2000, max(20, 0.7 * left / max(step, 1e-6))))
    partial["step_cap"] = cap
    res, dt = run_attack(ctx, "ig_closed_start", {**base, "iterations": cap, "device": dev, "cuda_graph": use_graph},
                         case.model_dev, case.update_dev, case.meta)
    trial = res.stats[0].get("trials", [{}])[0]
    steps = int(trial.get("iterations_run", res.stats[0].get("iterations", cap)))
    return dict(reference_32px=ref, size=ctx.size, s_per_step=round(per_step, 4), step_cap=cap, steps_run=steps,
                converged=bool(trial.get("converged")), s_to_stop=round(dt, 2), s_start=round(t_start, 3),
                converging_run_cuda_graph=use_graph,
                projected_s_2000_steps=round(t_start + 2000 * step, 1), psnr=round(psnr(estimate(res), case.truth), 2),
                step_profile=step_profile, cuda_graph=graph, computes_on=dev,
                checks={"ig_closed_start 32 px: device = CPU": ref["agrees"],
                        "cuda_graph steps = eager steps": graph.get("agrees", True)})


def graph_steps(ctx: Context, case: Case, options: dict, eager: Any, steps: tuple[int, int]) -> dict:
    """``cuda_graph``: seconds per step from two runs of ``steps`` steps (the recording cancels
    out), and its reconstruction after the eager probe's step count against the eager one's (the
    same steps to float32 rounding: >= 40 dB apart). On the CPU the option is ignored: not measured."""
    if not ctx.cuda:
        return dict(status="not measured: CUDA graphs need a CUDA device")
    times, last = [], None
    for n in steps:
        last, dt = run_attack(ctx, "ig_closed_start", {**options, "iterations": n, "converge_window": n,
                                                      "cuda_graph": True}, case.model_dev, case.update_dev, case.meta)
        times.append(dt)
    status = str(last.stats[0].get("steps_run_as"))
    if not status.startswith("CUDA graph"):
        return dict(status=status, agrees=False)
    per = max(times[1] - times[0], 0.0) / (steps[1] - steps[0])
    n_eager = int(eager.stats[0].get("iterations", 0))
    same, _ = run_attack(ctx, "ig_closed_start", {**options, "iterations": n_eager, "converge_window": n_eager,
                                                  "cuda_graph": True}, case.model_dev, case.update_dev, case.meta)
    apart = psnr(estimate(same), estimate(eager))
    return dict(status=status, s_per_step=round(per, 4), steps_compared=n_eager,
                graph_vs_eager_db=round(apart, 2), agrees=apart >= 40)


def profile_steps(ctx: Context, case: Case, options: dict, steps: tuple[int, int]) -> dict:
    """Per step of ``ig_closed_start`` (the difference of two profiled runs of ``steps`` steps): the
    operators dispatched, the device kernels launched and their summed device time, and the
    operators that take the most host and device time. A step whose kernels keep the device busy
    for a small share of its wall time is bound by launches and host work, not by arithmetic."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    runs = {}
    for n in steps:
        with profile(activities=activities) as prof:
            _, dt = run_attack(ctx, "ig_closed_start", {**options, "iterations": n, "converge_window": n},
                               case.model_dev, case.update_dev, case.meta)
        events = prof.events()
        cuda_type = getattr(torch.autograd, "DeviceType", None)
        kernels = sum(1 for e in events if cuda_type is not None and e.device_type == cuda_type.CUDA)
        kernels = kernels or sum(len(getattr(e, "kernels", []) or []) for e in events)
        table = prof.key_averages()
        device_us = sum(float(getattr(e, "self_device_time_total", 0.0) or 0.0) for e in table)
        runs[n] = dict(wall_s=dt, ops=len(events), kernels=kernels, device_s=device_us / 1e6,
                       table=[(e.key, e.count, float(e.self_cpu_time_total), float(getattr(e, "self_device_time_total", 0.0) or 0.0))
                              for e in table])
    lo, hi = runs[steps[0]], runs[steps[1]]
    span = steps[1] - steps[0]

    def per_step(key: str) -> float:
        return (hi[key] - lo[key]) / span

    def top(column: int) -> list[list]:
        rows = sorted(hi["table"], key=lambda r: -r[column])[:10]
        return [[k, c, round(cpu / 1e3, 1), round(dev / 1e3, 1)] for k, c, cpu, dev in rows]

    wall = per_step("wall_s")
    busy = per_step("device_s")
    return dict(steps=list(steps), s_per_step_profiled=round(wall, 4), ops_per_step=round(per_step("ops")),
                kernels_per_step=round(per_step("kernels")), device_busy_s_per_step=round(busy, 5),
                device_busy_share=round(busy / wall, 3) if wall > 0 and ctx.cuda else None,
                top_by_host_ms=top(2), top_by_device_ms=top(3) if ctx.cuda else [],
                columns="[operator, calls, self host ms, self device ms] over the longer run")


def _random_alexnet_features(path: Path) -> Path:
    """A seed-0 torchvision AlexNet's ``features.*`` weights written to ``path`` (an LPIPS trunk)."""
    import warnings

    import torchvision

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            net = torchvision.models.alexnet(weights=None)
    torch.save({k: v for k, v in net.state_dict().items() if k.startswith("features.")}, path)
    return path


def part_metrics(ctx: Context, seconds: float) -> dict:
    import metrics

    n, size = (8, 64) if ctx.quick else (256, 224)
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(n, 3, size, size, generator=gen)
    b = (a + 0.1 * torch.randn(n, 3, size, size, generator=gen)).clamp(0, 1)
    out: dict[str, Any] = dict(pairs=n, size=size)
    checks: dict[str, bool] = {}
    ad, bd = a.to(ctx.device), b.to(ctx.device)
    metrics.ssim(ad[:2], bd[:2])  # warm-up
    ctx.sync()
    t0 = time.perf_counter()
    vd = metrics.ssim(ad, bd)
    ctx.sync()
    out["ssim_pairs_per_s"] = round(n / (time.perf_counter() - t0), 1)
    diff = float((vd[:4].cpu().double() - metrics.ssim(a[:4], b[:4]).double()).abs().max())
    out["ssim_device_vs_cpu"] = float(f"{diff:.3g}")
    checks["ssim: device = CPU"] = diff <= 1e-6  # float64 on both
    try:
        model_dev = metrics.get_lpips_model(ctx.device, allow_download=False)
        model_cpu = metrics.get_lpips_model("cpu", allow_download=False)
        out["lpips_weights"] = metrics.lpips_source(model_dev)
    except metrics.LpipsUnavailable:
        # no trained trunk here: device against CPU holds for any trunk, so compare on a seeded one
        trunk = _random_alexnet_features(ctx.out / "alexnet_features_seed0.pth")
        model_dev = metrics.get_lpips_model(ctx.device, backbone_path=trunk)
        model_cpu = metrics.get_lpips_model("cpu", backbone_path=trunk)
        out["lpips_weights"] = "seeded random AlexNet trunk (no trained weights found)"
    metrics.lpips(ad[:2], bd[:2], model=model_dev)
    ctx.sync()
    t0 = time.perf_counter()
    vd = metrics.lpips(ad, bd, model=model_dev)
    ctx.sync()
    out["lpips_pairs_per_s"] = round(n / (time.perf_counter() - t0), 1)
    vc = metrics.lpips(a[:4], b[:4], model=model_cpu)
    diff = float((vd[:4].cpu().double() - vc.double()).abs().max())
    out["lpips_device_vs_cpu"] = float(f"{diff:.3g}")
    checks["lpips: device = CPU"] = diff <= 1e-4
    return {**out, "checks": checks}


def _train_rate(ctx: Context, recipe: str, amp: Optional[str], batch: int, steps: int,
                overrides: dict) -> dict:
    """Images/s of the recipe's model and optimiser (fedmjp.engine's step, no augmentation), and the
    float32 loss of one batch on the device against the CPU."""
    from timm.optim import create_optimizer_v2

    from fedmjp.engine import StepContext, TrainStep, train_one_epoch
    from fedmjp.factory import create_model
    from fedmjp.trainconfig import load_config
    from fedmjp.trainutils import DistInfo, amp_dtype, model_kwargs

    cfg = load_config(ROOT / recipe, overrides)
    classes = 10 if "cifar" in recipe else 1000
    torch.manual_seed(0)
    model = create_model(cfg.model, **model_kwargs(cfg, classes))
    x = torch.randn(batch * steps, 3, cfg.img_size, cfg.img_size, generator=torch.Generator().manual_seed(0))
    y = torch.arange(batch * steps) % classes
    # the same batch's float32 loss (eval mode: no drop path, no shuffle) on the CPU and the device
    model.eval()
    with torch.no_grad():
        loss_cpu = float(torch.nn.functional.cross_entropy(model(x[:2]), y[:2]))
        model.to(ctx.device)
        loss_dev = float(torch.nn.functional.cross_entropy(model(x[:2].to(ctx.device)), y[:2].to(ctx.device)))
    model.train()
    dtype = amp_dtype(amp or cfg.amp, ctx.device)
    loader = [(x[i:i + batch], y[i:i + batch]) for i in range(0, batch * steps, batch)]
    opt = create_optimizer_v2(model, opt=cfg.opt, lr=cfg.lr or 1e-4, weight_decay=cfg.weight_decay)
    step_ctx = StepContext(optimizer=opt, criterion=torch.nn.CrossEntropyLoss(), device=ctx.device,
                           info=DistInfo(device=ctx.device), amp_dtype=dtype, clip_grad=cfg.clip_grad,
                           scaler=torch.amp.GradScaler(ctx.device.type) if dtype == torch.float16 else None,
                           dal_lambda=cfg.dal_lambda, shuffle=True, progress=False)
    train_one_epoch(TrainStep(model), loader[:1], step_ctx, epoch=0, global_step=0)  # warm-up
    ctx.sync()
    t0 = time.perf_counter()
    stats, _ = train_one_epoch(TrainStep(model), loader, step_ctx, epoch=1, global_step=0)
    ctx.sync()
    rate = batch * steps / (time.perf_counter() - t0)
    rel = abs(loss_dev - loss_cpu) / max(abs(loss_cpu), 1e-12)
    return dict(recipe=recipe, model=cfg.model, img_size=cfg.img_size, batch=batch, steps=steps,
                amp=str(dtype).replace("torch.", "") if dtype else "none", images_per_s=round(rate, 1),
                loss=round(float(stats.get("loss", float("nan"))), 4), loss_fp32_device=loss_dev,
                loss_fp32_cpu=loss_cpu, checks={"float32 loss: device = CPU": rel <= 1e-3,
                                                "training loss finite": math.isfinite(float(stats.get("loss", 0.0)))})


def part_train_deit_s(ctx: Context, seconds: float) -> dict:
    if ctx.quick:
        return _train_rate(ctx, "configs/train/deit_s_mjp.yaml", "bf16", 2, 2,
                           {"model_kwargs": {"depth": 1}, "img_size": 64, "drop_path": 0.0})
    return _train_rate(ctx, "configs/train/deit_s_mjp.yaml", "bf16", 128, 10, {})


def part_train_cifar(ctx: Context, seconds: float) -> dict:
    return _train_rate(ctx, "configs/train/cifar_deit_mjp.yaml", None, 8 if ctx.quick else 64,
                       2 if ctx.quick else 30, {"model_kwargs": {"depth": 1}} if ctx.quick else {})


def _benchmark_run(ctx: Context, device: str, args: list[str], out: Path, seconds: float) -> tuple[float, dict]:
    """(wall seconds, {(row, attack, setting, image): psnr}) of one run_benchmark.py subprocess."""
    cmd = [sys.executable, str(ROOT / "run_benchmark.py"), *args, "--device", device, "--no-progress",
           "--output", str(out)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired as err:  # where the run was when stopped: the end of its log
        tail = err.stderr or err.stdout or ""
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise subprocess.TimeoutExpired(err.cmd, err.timeout, output=None,
                                        stderr=f"{device} run stopped after {seconds:.0f} s; its log ends: "
                                               f"{tail[-400:]}") from None
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"run_benchmark.py exit status {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}")
    rows = {}
    for line in (out / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("psnr") is not None:
            key = "|".join(str(r.get(k)) for k in ("model", "attack", "setting", "group", "image_id"))
            rows[key] = float(r["psnr"])
    return dt, rows


def _preset(ctx: Context, seconds: float, name: str, args: list[str]) -> dict:
    out = ctx.out / f"run_{name}"
    import shutil

    for sub in ("device", "cpu"):
        shutil.rmtree(out / sub, ignore_errors=True)
    res: dict[str, Any] = dict(args=" ".join(args))
    ctx.partial[f"preset_{name}"] = res  # what is measured below is kept if a run then runs over
    t_dev, dev_rows = _benchmark_run(ctx, str(ctx.device), args, out / "device", seconds)
    res.update(s_device=round(t_dev, 1), rows=len(dev_rows))
    if not ctx.cuda:
        res["cpu_reference"] = "the device is the CPU"
        return {**res, "checks": {"rows scored": bool(dev_rows)}}
    t_cpu, cpu_rows = _benchmark_run(ctx, "cpu", args, out / "cpu", seconds - t_dev)
    common = dev_rows.keys() & cpu_rows.keys()
    diffs = {k: abs(min(dev_rows[k], 100.0) - min(cpu_rows[k], 100.0)) for k in common}
    worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    res.update(s_cpu=round(t_cpu, 1), max_abs_psnr_diff_db=round(max(diffs.values(), default=0.0), 4),
               worst_rows={k: round(d, 4) for k, d in worst})
    return {**res, "checks": {"rows scored": bool(dev_rows), "same rows on CPU": common == dev_rows.keys(),
                              f"PSNR: device = CPU ({PRESET_TOL_DB} dB)":
                                  max(diffs.values(), default=0.0) <= PRESET_TOL_DB}}


#: The presets' clients train in float32 on each device, so even the closed forms attack updates that
#: differ by float32 rounding (relative 1e-6, `closed_forms` part), and the optimised attacks follow
#: another rounding path: on an H100 (2026-11-26) the default preset's rows differed from the CPU's
#: by at most 0.057 dB. A device fault costs whole decibels.
PRESET_TOL_DB = 0.5


#: --quick attackers of both presets: every attacker's code path at its cheapest options
QUICK_ATTACKS = ("{name: april_analytic}, {name: pe_closed_form}, "
                 "{name: mjp_adaptive, options: {refine: prior, tv_prior: false}}")


def part_preset_default(ctx: Context, seconds: float) -> dict:
    args = ["--setting", "all"]
    if ctx.quick:  # two rows (plain, MJP), two images on two clients, one round
        args += ["--num-images", "2", "--clients", "2", "--rounds", "1", "--models", "DeiT", "DeiT+MJP",
                 "--set", f"attacks=[{QUICK_ATTACKS}]"]
    return _preset(ctx, seconds, "default", args)


def part_preset_cifar(ctx: Context, seconds: float) -> dict:
    # two images on two clients: the CPU reference runs the same attackers (mjp_adaptive solves 32 px
    # models on the CPU on either device, ~35 CPU-s per shuffled update), inside the part's budget
    args = ["--config", "configs/cifar.yaml", "--models", "DeiT", "DeiT+MJP", "--setting", "all",
            "--num-images", "2", "--clients", "2", "--rounds", "1"]
    if ctx.data is None or not (ctx.data / "cifar10.tar.gz").is_file():
        if not ctx.quick:
            raise PartSkipped("the CIFAR preset reads $FEDMJP_DATA/cifar10.tar.gz; FEDMJP_DATA does not provide it")
        args += ["--set", "data.source=embedded"]  # --quick: the shipped checkpoints on the bundled images
    if ctx.quick:
        attack_list = (f"attacks=[{QUICK_ATTACKS}, {{name: april_robust, options: {{iterations: 1, cg_maxiter: 20}}}}, "
                       "{name: ig_closed_start, options: {iterations: 3, restarts: 1, start_attacks: [pe_closed_form]}}]")
    else:
        attack_list = ("attacks=[{name: april_analytic}, {name: pe_closed_form}, {name: april_robust}, "
                       "{name: mjp_adaptive}, {name: ig_closed_start, options: {iterations: 100, restarts: 1}}]")
    return _preset(ctx, seconds, "cifar", args + ["--set", attack_list])


def part_projection(ctx: Context) -> dict:
    """The paper preset per attacker on one device, from the per-image figures measured above."""
    r = ctx.results
    per: dict[str, Optional[float]] = {}
    closed = r.get("closed_forms", {}).get("rows", [])
    for name in ("pe_closed_form", "april_analytic"):
        times = [row["s_device"] for row in closed if row["attack"] == name]
        per[name] = max(times) if times else None
    per["april_robust"] = r.get("april_robust", {}).get("s_per_image")
    per["mjp_adaptive"] = r.get("mjp_adaptive", {}).get("s_per_image")
    ig = r.get("ig_closed_start", {})
    per["ig_closed_start"] = (ig.get("s_to_stop") if ig.get("converged") else ig.get("projected_s_2000_steps"))
    updates = PAPER_ROWS * PAPER_GROUPS * PAPER_IMAGES
    full_mjp = PAPER_MJP_ROWS * PAPER_IMAGES  # shuffled updates of the E_unk row
    hours: dict[str, Optional[float]] = {}
    for name, s in per.items():
        if s is None:
            hours[name] = None
        elif name == "mjp_adaptive":  # elsewhere it is the closed form
            hours[name] = (full_mjp * s + (updates - full_mjp) * (per["april_analytic"] or 0.0)) / 3600
        else:
            hours[name] = updates * s / 3600
    known = [hours[n] for n in ("pe_closed_form", "april_analytic", "april_robust", "mjp_adaptive")]
    core = sum(known) if all(v is not None for v in known) else None  # type: ignore[misc]
    ig_h = hours.get("ig_closed_start")
    plan = {}
    for gpus in (1, 2, 4, 8):
        total = None if core is None else core + (ig_h or 0.0)
        plan[f"{gpus} GPU"] = None if total is None else round(total / gpus, 2)
    fits = None if core is None else core * 3600 <= AIM_CLOSED_ROBUST_MJP_S
    ig_ok = None if per["ig_closed_start"] is None else per["ig_closed_start"] <= AIM_IG_CONVERGED_S
    return dict(measured_on=str(ctx.device), quick=ctx.quick, updates=updates,
                s_per_image={k: (None if v is None else round(v, 4)) for k, v in per.items()},
                hours_one_device={k: (None if v is None else round(v, 3)) for k, v in hours.items()},
                closed_robust_mjp_hours=None if core is None else round(core, 3),
                aim_closed_robust_mjp_under_1h=fits, aim_ig_converged_under_60s=ig_ok,
                hours_all_attackers_by_gpus=plan,
                attack_workers_plan=("--attack-workers N runs N Ray actors that request CPUs only "
                                     "(benchmark/workers.py): on G GPUs, run G benchmark processes, one per "
                                     "CUDA_VISIBLE_DEVICES, each on a disjoint --models subset (5 rows), "
                                     "or give every actor num_gpus=1/k; the per-GPU hours above assume an even split"),
                checks={"every attacker measured": all(v is not None for v in per.values())})


# ------------------------------------------------------------------------------------ driver
#: (name, budget in seconds on one H100, function); every function takes (ctx, seconds) or (ctx).
PARTS: list[tuple[str, float, Callable[..., dict]]] = [
    ("env", 20, part_env),
    ("pytest_cuda", 100, part_pytest_cuda),
    ("closed_forms", 30, part_closed_forms),
    ("april_robust", 45, part_april_robust),
    ("mjp_adaptive", 60, part_mjp_adaptive),
    ("ig_closed_start", 80, part_ig_closed_start),
    ("metrics", 15, part_metrics),
    ("train_deit_s", 25, part_train_deit_s),
    ("train_cifar", 15, part_train_cifar),
    # before the presets: it reads only the attack parts' figures, and a run stopped in a preset keeps it
    ("projection", 5, part_projection),
    # each preset runs twice (the device, then the CPU for the reference) in its budget: on an H100
    # (2026-11-26) the default preset's device run alone took 29 s, over the 40 s then given to both
    ("preset_default", 70, part_preset_default),
    ("preset_cifar", 100, part_preset_cifar),
    # last: at 224 px a sketch of ~1.2e4 vector-Jacobian products and ~3 x 300 CG steps, not yet timed on a GPU
    ("span_lm", 240, part_span_lm),
]


def write_report(ctx: Context, record: dict) -> None:
    """gpu_check.json and gpu_check.md in ``ctx.out`` (rewritten whole after every part)."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    tmp = ctx.out / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(record, indent=1, default=str))
    tmp.replace(ctx.out / "gpu_check.json")
    lines = [f"# GPU check on {record['device']}", "", f"`{record['command']}`, started {record['started']}", "",
             "| part | status | seconds | budget | checks | key figures |", "|---|---|---|---|---|---|"]
    for name, part in record["parts"].items():
        res = part.get("result", {})
        checks = res.get("checks", {})
        bad = [k for k, v in checks.items() if not v]
        figures = {k: v for k, v in res.items() if k not in ("checks", "rows") and not isinstance(v, (dict, list))}
        text = "; ".join(f"{k} {v}" for k, v in list(figures.items())[:8])
        lines.append(f"| {name} | {part['status']} | {part['seconds']} | {part['budget_s']} | "
                     f"{len(checks) - len(bad)}/{len(checks)}{' failed: ' + ', '.join(bad) if bad else ''} | "
                     f"{' '.join((part.get('error') or text).split())[:400].replace('|', '/')} |")  # one line a row
    rows = record["parts"].get("closed_forms", {}).get("result", {}).get("rows", [])
    if rows:
        lines += ["", "| attack | update | s device | s CPU | PSNR device | PSNR CPU | device vs CPU | victim grad diff |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['attack']} | {r['update']} | {r['s_device']} | {r['s_cpu']} | {r['psnr_device']} | "
                  f"{r['psnr_cpu']} | {r['psnr_device_vs_cpu']} | {r['victim_grad_rel_diff']} |" for r in rows]
    prof = record["parts"].get("ig_closed_start", {}).get("result", {}).get("step_profile")
    if prof:
        lines += ["", "ig_closed_start, one step: " + "; ".join(
            f"{k} {v}" for k, v in prof.items() if not isinstance(v, list))]
    proj = record["parts"].get("projection", {}).get("result")
    if proj:
        lines += ["", "Paper preset projection (hours on one device): "
                  + ", ".join(f"{k} {v}" for k, v in proj["hours_one_device"].items())
                  + f"; all attackers by GPUs: {proj['hours_all_attackers_by_gpus']}"]
    span = record["parts"].get("span_lm", {}).get("result", {})
    if span.get("iterations"):
        lines += ["", f"span_lm at {span['size']} px ({span['unknowns']} unknowns, {span['rows']} rows, sketch "
                  f"{span.get('sketch_rows')}): x~ {span['psnr_start']} dB -> " + ", ".join(
                      f"{it['psnr']} dB ({it['residual']:.1e}, {it['s']} s)" for it in span["iterations"])
                  + f"; CG iterations {span.get('cg_iterations')}"]
    (ctx.out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def run_parts(ctx: Context, only: Optional[set[str]], scale: float, command: str) -> dict:
    record: dict[str, Any] = dict(command=command, device=str(ctx.device), quick=ctx.quick,
                                  started=time.strftime("%Y-%m-%d %H:%M:%S"), parts={})
    for name, seconds, fn in PARTS:
        if only and name not in only:
            continue
        limit = seconds * scale
        entry: dict[str, Any] = dict(status="running", budget_s=round(limit), seconds=None)
        record["parts"][name] = entry
        t0 = time.perf_counter()
        try:
            if ctx.lost and name not in OWN_PROCESS_PARTS:
                raise PartLost(f"not run: this process's CUDA context was lost in part {ctx.lost}; "
                               f"rerun with --only {name}")
            with budget(limit):
                result = fn(ctx, limit) if fn.__code__.co_argcount == 2 else fn(ctx)
            ctx.results[name] = result
            failed = [k for k, v in result.get("checks", {}).items() if not v]
            entry.update(status="check failed" if failed else "ok", result=result)
        except PartSkipped as err:
            entry.update(status="skipped", error=str(err))
        except PartLost as err:
            entry.update(status="not run", error=str(err))
        except subprocess.TimeoutExpired as err:
            entry.update(status="timeout", error=f"TimeoutExpired: {err.stderr or err}")
        except PartTimeout as err:
            entry.update(status="timeout", error=f"{type(err).__name__}: {err}")
        except Exception as err:  # noqa: BLE001  (one failing part must not lose the others)
            entry.update(status="error", error=f"{type(err).__name__}: {err}",
                         traceback=traceback.format_exc(limit=6)[-2000:])
            if ctx.cuda and context_lost(err):
                ctx.lost = f"{name}: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
        if entry["status"] in ("timeout", "error") and ctx.partial.get(name):
            entry["result"] = dict(ctx.partial[name], checks={})  # the figures measured before it stopped
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"[gpu_check] {name:16s} {entry['status']:12s} {entry['seconds']:7.1f} s"
              + (f"  {entry.get('error', '')[:200]}" if entry.get("error") else ""), flush=True)
        write_report(ctx, record)
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_report(ctx, record)
    return record


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes in every part (seconds each)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check", help="folder of gpu_check.json/.md")
    p.add_argument("--only", nargs="+", metavar="PART", choices=[n for n, _, _ in PARTS], help="run these parts only")
    p.add_argument("--budget-scale", type=float, default=None,
                   help="multiply every part's budget (default 1 on CUDA, 20 on the CPU: the budgets are an H100's)")
    args = p.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.budget_scale is not None and not args.budget_scale > 0:
        print(f"error: --budget-scale must be > 0, got {args.budget_scale}", file=sys.stderr)
        return 2
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"error: --out {args.out}: {err}", file=sys.stderr)
        return 2
    data = Path(os.environ["FEDMJP_DATA"]) if os.environ.get("FEDMJP_DATA") else None
    scale = args.budget_scale if args.budget_scale is not None else (1.0 if device.type == "cuda" else 20.0)
    ctx = Context(device=device, quick=args.quick, out=args.out, data=data)
    command = "python bench/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    record = run_parts(ctx, set(args.only) if args.only else None, scale, command)
    bad = [n for n, part in record["parts"].items() if part["status"] not in ("ok", "skipped")]
    print(f"[gpu_check] {len(record['parts']) - len(bad)}/{len(record['parts'])} parts ok"
          + (f"; not ok: {', '.join(bad)}" if bad else "") + f"; {args.out / 'gpu_check.json'}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
