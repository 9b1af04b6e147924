"""MJP core: masking, jigsaw shuffle, E_unk gradients, DAL, model registry, checkpoints."""
from __future__ import annotations

import pytest
import timm
import torch

import fedmjp
from fedmjp.checkpoint import CheckpointError, load_checkpoint, official_state_dict
from fedmjp.dal import dal_weight
from fedmjp.factory import build_model
from fedmjp.jigsaw import make_plan, make_spp_plan, patchify, shuffle_images, unshuffle_images
from fedmjp.masking import BlockMaskGenerator
from fedmjp.models import VARIANTS, AprilBlock, MJPVisionTransformer, april_surgery

TINY = dict(img_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3, num_classes=10)


def tiny(variant: str = "mjp", **kw) -> MJPVisionTransformer:
    torch.manual_seed(0)
    return MJPVisionTransformer(variant=variant, **{**TINY, **kw})


# ----------------------------------------------------------------------------- masking
@pytest.mark.parametrize("grid", [(14, 14), (8, 8)])
@pytest.mark.parametrize("gamma", [0.1, 0.27, 0.5])
def test_mask_count_averages_to_target(grid, gamma):
    gen = BlockMaskGenerator(grid, gamma)
    counts = torch.tensor([gen(seed).sum().item() for seed in range(400)], dtype=torch.float64)
    assert gen.target == int(grid[0] * grid[1] * gamma)
    assert abs(counts.mean().item() - gen.target) <= 0.03 * gen.target
    assert counts.max().item() <= gen.target  # never overshoots, like BEiT's generator


def test_mask_is_seeded_and_blockwise():
    gen = BlockMaskGenerator((14, 14), 0.27)
    a, b, c = gen(7), gen(7), gen(8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(gen(g1), gen(g2))
    mask, blocks = gen.draw(7)
    assert torch.equal(mask, a)
    union = torch.zeros_like(mask)
    for top, left, h, w in blocks:
        assert 0 <= top and top + h <= 14 and 0 <= left and left + w <= 14 and h * w >= 1
        union[top:top + h, left:left + w] = True
    assert torch.equal(union, mask)  # the mask is exactly the union of the placed rectangles
    assert len(blocks) < mask.sum() / 2  # a few blocks, not scattered cells
    # Blocks, not scattered cells: most selected cells have a selected 4-neighbour.
    m = a.float()
    nb = torch.zeros_like(m)
    nb[1:] += m[:-1]; nb[:-1] += m[1:]; nb[:, 1:] += m[:, :-1]; nb[:, :-1] += m[:, 1:]
    assert ((nb > 0) & a).sum() >= 0.9 * a.sum()


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "x"])
def test_bad_gamma_raises(bad):
    with pytest.raises(ValueError, match="gamma"):
        BlockMaskGenerator((8, 8), bad)
    with pytest.raises(ValueError, match="gamma"):
        tiny(gamma=bad)


def test_bad_sizes_and_names_raise():
    with pytest.raises(ValueError, match="not divisible"):
        tiny(img_size=30)
    with pytest.raises(ValueError, match="valid: plain"):
        tiny(variant="mjpp")
    with pytest.raises(ValueError, match="pe_init"):
        tiny(pe_init="zeros")


# ----------------------------------------------------------------------------- shuffle
@pytest.mark.parametrize("per_sample", [True, False])
def test_shuffle_moves_only_selected_and_inverts(per_sample):
    x = torch.rand(4, 3, 32, 32)
    plan = make_plan(4, (8, 8), 0.5, seed=1, per_sample=per_sample)
    xs = shuffle_images(x, plan, 4)
    px, ps = patchify(x, 4).flatten(2), patchify(xs, 4).flatten(2)
    for b in range(4):
        keep = ~plan.mask[b]
        assert torch.equal(px[b][keep], ps[b][keep])  # unselected patches stay put
        sel = plan.mask[b]
        # the multiset of patches at selected positions is unchanged
        a = sorted(map(tuple, px[b][sel].tolist()))
        c = sorted(map(tuple, ps[b][sel].tolist()))
        assert a == c
    assert not torch.equal(xs, x)
    assert torch.equal(unshuffle_images(xs, plan, 4), x)
    if not per_sample:
        assert (plan.mask == plan.mask[:1]).all() and (plan.perm == plan.perm[:1]).all()
    else:
        assert not (plan.mask == plan.mask[:1]).all()


def test_spp_inverts_and_moves_pixels():
    x = torch.rand(2, 3, 16, 16)
    plan = make_spp_plan(2, (4, 4), 4, seed=0)
    xs = shuffle_images(x, plan, 4)
    assert torch.equal(unshuffle_images(xs, plan, 4), x)
    assert torch.allclose(xs.sum((2, 3)), x.sum((2, 3)), atol=1e-4)
    assert not torch.equal(patchify(xs, 4).sort(-1).values, patchify(x, 4).sort(-1).values)


def test_token_shuffle_equals_pixel_shuffle():
    model = tiny("mjp").eval()
    x = torch.rand(2, 3, 32, 32)
    plan = model.draw_plan(2, gamma=0.4, seed=3, per_sample=True)
    a = model(x, plan=plan)
    b = model(model.shuffle_images(x, plan), unk_mask=plan.mask)
    assert torch.allclose(a, b, atol=1e-5)


# ----------------------------------------------------------------------------- model
@pytest.mark.parametrize("variant", ["plain", "jp", "jp_unk", "mjp"])
def test_no_shuffle_equals_plain_timm(variant):
    model = tiny(variant).eval()
    ref = timm.models.vision_transformer.VisionTransformer(**TINY).eval()
    missing, unexpected = ref.load_state_dict(model.state_dict(), strict=False)
    assert not missing and set(unexpected) <= {"unk_embed", "dal_head.layers.0.weight", "dal_head.layers.0.bias",
                                               "dal_head.layers.2.weight", "dal_head.layers.2.bias"}
    x = torch.rand(3, 3, 32, 32)
    assert torch.allclose(model(x), ref(x), atol=1e-6)
    model.train(), ref.train()
    assert torch.allclose(model(x), ref(x), atol=1e-6)  # forward never shuffles by itself


def test_eval_mode_never_shuffles_and_train_does():
    model = tiny("mjp", seed=0)
    x = torch.rand(2, 3, 32, 32)
    model.eval()
    assert model.forward_mjp(x).plan is None
    model.train()
    out = model.forward_mjp(x)
    assert out.plan is not None and out.plan.mask.sum() == 2 * int(64 * 0.27)
    assert out.dal_loss is not None and out.dal_loss.ndim == 0


def test_registry_names_create_models():
    for name, dim in [("mjp_deit_tiny_patch16_224", 192), ("mjp_deit_small_patch16_224", 384),
                      ("mjp_deit_base_patch16_224", 768)]:
        m = timm.create_model(name, depth=1)
        assert isinstance(m, MJPVisionTransformer) and m.embed_dim == dim and m.grid_size == (14, 14)
    cifar = timm.create_model("mjp_vit_cifar_patch4_32", variant="jp_idx", depth=1)
    assert cifar.grid_size == (8, 8) and cifar.index_embed is not None
    nope = timm.create_model("mjp_vit_cifar_patch4_32", variant="nope", depth=1)
    assert nope.pos_embed is None
    assert nope(torch.rand(1, 3, 32, 32)).shape == (1, 10)


def test_unk_gradient_is_sum_of_shuffled_token_gradients():
    model = tiny("jp_unk").eval()
    x = torch.rand(2, 3, 32, 32)
    plan = model.draw_plan(2, gamma=0.4, seed=5, per_sample=True)
    captured = {}

    def hook(module, args, output):
        output.retain_grad()
        captured["tokens"] = output

    # Gradient w.r.t. the embedded tokens entering block 0 (= patch tokens + PE/E_unk).
    handle = model.pos_drop.register_forward_hook(hook)
    loss = model(x, plan=plan).logsumexp(-1).sum()
    loss.backward()
    handle.remove()
    g_tok = captured["tokens"].grad[:, model.num_prefix_tokens:]  # [B, N, D]
    expected = (g_tok * plan.mask.unsqueeze(-1)).sum((0, 1))
    assert torch.allclose(model.unk_embed.grad.flatten(), expected, atol=1e-6)
    pe_grad = model.pos_embed.grad[0, model.num_prefix_tokens:]
    always_shuffled = plan.mask.all(0)
    assert always_shuffled.any()
    assert torch.count_nonzero(pe_grad[always_shuffled]) == 0
    # and rows kept in some sample do get a gradient
    assert pe_grad[~plan.mask.any(0)].abs().sum() > 0


@pytest.mark.parametrize("head", ["nln", "ln", "pca"])
def test_dal_training_pes_lowers_loss(head):
    model = tiny("mjp", dal_head=head, dal_normalize=True)
    if head == "pca":
        assert sum(p.numel() for p in model.dal_head.parameters()) == 0
    params = [model.pos_embed] + list(model.dal_head.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)
    keep = ~make_plan(4, (8, 8), 0.27, seed=0, per_sample=True).mask
    first = model.compute_dal_loss(keep).item()
    for _ in range(60):
        opt.zero_grad()
        loss = model.compute_dal_loss(keep)
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first


def test_dal_weight_schedule():
    assert dal_weight(5, 100) == 0.01
    assert dal_weight(0, 100, warmup_steps=10, schedule="official") == 0.0
    assert dal_weight(10, 100, warmup_steps=10, schedule="official") == pytest.approx(0.01)
    assert dal_weight(100, 100, warmup_steps=10, schedule="official") == pytest.approx(0.005)
    with pytest.raises(ValueError, match="schedule"):
        dal_weight(1, 10, schedule="linear")


def test_pe_init_official_and_weight_decay():
    timm_init = tiny("mjp")
    official = tiny("mjp", pe_init="official")
    assert timm_init.pos_embed.std() < 0.05 and 0.8 < official.pos_embed.std() < 1.2
    assert "pos_embed" in timm_init.no_weight_decay() and "unk_embed" in timm_init.no_weight_decay()
    assert "pos_embed" not in official.no_weight_decay()


# ----------------------------------------------------------------------------- APRIL design A
def test_april_block_and_surgery():
    built = tiny("plain", first_block="april")
    assert isinstance(built.blocks[0], AprilBlock) and not hasattr(built.blocks[0].norm1, "weight")
    model = tiny("plain").eval()
    x = torch.rand(1, 3, 32, 32)
    before = model(x)
    april_surgery(model)
    assert isinstance(model.blocks[0], AprilBlock)
    assert not torch.allclose(model(x), before)
    # design A: block 0 output = attn(z) + mlp(norm2(attn(z))) with no residual from z
    blk = model.blocks[0]
    z = torch.rand(1, 65, TINY["embed_dim"])
    a = blk.attn(z)
    assert torch.allclose(blk(z), a + blk.mlp(blk.norm2(a)), atol=1e-6)


# ----------------------------------------------------------------------------- checkpoints
def test_official_checkpoint_round_trip(tmp_path):
    src = tiny("mjp", dal_head="ln")
    path = tmp_path / "official.pth"
    state = official_state_dict(src)
    assert state["pos_embed.weight"].shape == (64 + 2, TINY["embed_dim"])  # cls, N patches, unk
    torch.save({"model": state}, path)
    dst = tiny("mjp", dal_head="ln")
    torch.nn.init.zeros_(dst.pos_embed)
    report = load_checkpoint(dst, path)
    assert report.official_format
    for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), k


def test_checkpoint_mismatch_lists_keys(tmp_path):
    path = tmp_path / "plain.pth"
    torch.save(tiny("plain").state_dict(), path)
    with pytest.raises(CheckpointError, match="missing from checkpoint.*unk_embed"):
        load_checkpoint(tiny("jp_unk"), path)
    torch.save(tiny("plain", embed_dim=96).state_dict(), path)
    with pytest.raises(CheckpointError, match="shape mismatches"):
        load_checkpoint(tiny("plain"), path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tiny("plain"), tmp_path / "nope.pth")


def test_checkpoint_refuses_pickled_objects(tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"model": tiny("plain").state_dict(), "obj": object()}, path)
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(tiny("plain"), path)


def test_build_model_spec_seeded_and_surgery(tmp_path):
    spec = dict(name="m", arch="mjp_vit_cifar_patch4_32", variant="mjp", kwargs=dict(depth=1), seed=3)
    a, b = build_model(spec), build_model(spec)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    path = tmp_path / "ckpt.pth"
    torch.save({"model": a.state_dict(), "epoch": 1}, path)
    c = build_model(dict(spec, checkpoint=str(path), april="surgery", seed=9))
    assert isinstance(c.blocks[0], AprilBlock) and c.fedmjp_trained
    with pytest.raises(ValueError, match="valid: mjp_deit"):
        build_model(dict(spec, arch="resnet50"))


def test_every_variant_forward_and_backward():
    for variant in VARIANTS:
        model = tiny(variant, seed=1).train()
        out = model.forward_mjp(torch.rand(2, 3, 32, 32))
        loss = out.logits.sum() + (out.dal_loss if out.dal_loss is not None else 0)
        loss.backward()
        assert torch.isfinite(loss)


def test_timm_builder_features_overlay_and_pretrained_refusal():
    """The MJP models are built by timm's build_model_with_cfg: features_only gives the blocks'
    outputs as [B, D, H, W] maps, pretrained_cfg_overlay changes the recorded input statistics, the
    224 px models carry DeiT's weights cfg and the CIFAR model (no published weights) refuses
    pretrained=True."""
    from fedmjp.factory import model_input_stats

    feats = timm.create_model("mjp_vit_cifar_patch4_32", features_only=True, depth=4, out_indices=(1, 3))
    with torch.no_grad():
        out = feats(torch.randn(2, 3, 32, 32))
    assert [tuple(f.shape) for f in out] == [(2, 192, 8, 8), (2, 192, 8, 8)]
    model = timm.create_model("mjp_vit_cifar_patch4_32", pretrained_cfg_overlay=dict(mean=(0.5, 0.5, 0.5)))
    assert model_input_stats(model)[0] == (0.5, 0.5, 0.5)
    deit = timm.create_model("mjp_deit_tiny_patch16_224", variant="mjp", depth=1)
    assert deit.variant == "mjp" and deit.pretrained_cfg["hf_hub_id"] == "timm/deit_tiny_patch16_224.fb_in1k"
    with pytest.raises(ValueError, match="no pretrained weights"):
        timm.create_model("mjp_vit_cifar_patch4_32", pretrained=True)
