"""Lists of samples split by item (Note [Lists of samples] in csrc/torchdp/shares.h): models that
take a list of images of different sizes and a list of target dicts, against one device, and the
refusal of such lists without ``samples``."""

from __future__ import annotations

import pytest
import torch
from dp_testing import clone_module, cpu_devices
from torch import nn

import torchdp


class Detector(nn.Module):
    """A detection-like model: one output dict per image (of the image's own size), and in
    training a loss averaged over the images, from their target dicts."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, images, targets=None):
        outs = []
        for image in images:
            features = self.conv(image.unsqueeze(0))[0]
            scores = features.mean(dim=(1, 2))
            outs.append(
                {"scores": scores, "boxes": features.flatten(1)[:, :4], "size": image.shape}
            )
        if targets is None:
            return outs
        losses = [
            (o["scores"].sum() - t["boxes"].sum()) ** 2 + o["boxes"].mean() * t["labels"].sum()
            for o, t in zip(outs, targets, strict=True)
        ]
        return {"loss": sum(losses) / len(images)}


def images_and_targets(n: int) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    images = [torch.randn(3, 9 + i, 14 - i) for i in range(n)]
    targets = [{"boxes": torch.randn(i + 1, 4), "labels": torch.ones(i + 1)} for i in range(n)]
    return images, targets


def assert_same_detections(got, ref) -> None:
    assert isinstance(got, list) and len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.keys() == b.keys() and a["size"] == b["size"], i
        torch.testing.assert_close(a["scores"], b["scores"], msg=f"image {i}")
        torch.testing.assert_close(a["boxes"], b["boxes"], msg=f"image {i}")


@pytest.mark.parametrize(
    ("devices", "images", "shares"),
    [(2, 5, None), (4, 3, None), (3, 7, [1, 2, 2]), (3, 4, [0, 1, 3])],
)
def test_eval_per_image_equals_one_device(devices, images, shares):
    torch.manual_seed(0)
    net = Detector().eval()
    dp = torchdp.DataParallel(net, devices=cpu_devices(devices), samples=True, shares=shares)
    imgs, _ = images_and_targets(images)
    with torch.no_grad():
        assert_same_detections(dp(imgs), net(imgs))


def test_training_loss_and_gradients_equal_one_device():
    # Each replica returns its images' mean loss (a vector of them, as nn.DataParallel gathers
    # scalars); weighted by each replica's images (share_rows), it is the whole batch's.
    torch.manual_seed(1)
    net = Detector()
    ref = clone_module(net)
    imgs, targets = images_and_targets(6)
    dp = torchdp.DataParallel(net, devices=cpu_devices(4), samples=True)
    losses = dp(imgs, targets)["loss"]
    counts = torch.tensor([c for c in torchdp.share_rows([1] * 4, 6) if c], dtype=losses.dtype)
    assert counts.tolist() == [2, 2, 1, 1] and losses.shape == (4,)
    loss = (losses * counts).sum() / counts.sum()
    expected = ref(imgs, targets)["loss"]
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_named_arguments_and_batch_tensors_beside_the_lists():
    class Scaled(Detector):
        def forward(self, images, scale, *, targets=None, tag="x"):
            outs = super().forward(images)
            assert tag == "eval" and targets is not None and len(targets) == len(images)
            return [dict(o, scores=o["scores"] * s) for o, s in zip(outs, scale, strict=True)]

    torch.manual_seed(2)
    net = Scaled().eval()
    imgs, targets = images_and_targets(5)
    scale = torch.arange(1.0, 6.0)
    dp = torchdp.DataParallel(net, devices=cpu_devices(2), samples=[0, "targets"])
    with torch.no_grad():
        got = dp(imgs, scale, targets=targets, tag="eval")
        assert_same_detections(got, net(imgs, scale, targets=targets, tag="eval"))
    with pytest.raises(
        ValueError, match=r"positional argument 1 of shape \[4\].*one row per sample"
    ):
        dp(imgs, scale[:4], targets=targets, tag="eval")


def test_functional_forms():
    torch.manual_seed(3)
    net = Detector().eval()
    imgs, targets = images_and_targets(5)
    with torch.no_grad():
        got = torchdp.data_parallel(net, (imgs,), devices=cpu_devices(2), samples=True)
        assert_same_detections(got, net(imgs))
    args, kws = torchdp.scatter_kwargs(
        (imgs, "tag"), {"targets": targets}, cpu_devices(2), samples=True
    )
    assert [len(a[0]) for a in args] == [3, 2] and [a[1] for a in args] == ["tag", "tag"]
    assert [len(k["targets"]) for k in kws] == [3, 2]
    torch.testing.assert_close(kws[1]["targets"][0]["boxes"], targets[3]["boxes"])
    joined = torchdp.gather([[{"a": torch.ones(2)}], [{"a": torch.zeros(3)}]], "cpu", samples=True)
    assert [d["a"].shape[0] for d in joined] == [2, 3]


def test_lists_that_cannot_be_one_batch_are_refused_without_samples():
    net = Detector()
    imgs, targets = images_and_targets(3)
    dp = torchdp.DataParallel(net, devices=cpu_devices(4))
    # Images of 3 channels on 4 devices: each would be cut along its channels.
    with pytest.raises(
        ValueError,
        match=r"(?s)positional argument 0 holds tensors of different "
        r"shapes with only 3 rows along dim 0 for 4 devices.*samples=True",
    ):
        dp(imgs)
    # Target dicts with different numbers of boxes: the dicts' tensors cannot be one batch.
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    with pytest.raises(
        ValueError,
        match=r"(?s)positional argument 1\[\*\]\['boxes'\] holds "
        r"tensors of different sizes \[1, 2, 3\] along dim 0.*samples=True",
    ):
        dp(imgs, targets)
    with pytest.raises(ValueError, match=r"keyword argument 'xs' holds tensors of different sizes"):
        torchdp.data_parallel(
            nn.Identity(),
            (),
            devices=cpu_devices(2),
            module_kwargs={"xs": [torch.ones(4, 2), torch.ones(2, 2)]},
        )


def test_batch_lists_still_split_along_dim():
    # Tensors of one batch in a list (a model's several inputs) split as before.
    class Two(nn.Module):
        def forward(self, xs):
            return xs[0] * 2 + xs[1].sum(dim=1, keepdim=True)

    net = Two()
    xs = [torch.randn(6, 3), torch.randn(6, 5)]
    dp = torchdp.DataParallel(net, devices=cpu_devices(3))
    torch.testing.assert_close(dp(xs), net(xs))
    # A batch smaller than the device list, of equal shapes, is a batch: fewer replicas run.
    small = [torch.randn(2, 3), torch.randn(2, 3)]
    torch.testing.assert_close(dp(small), net(small))


def test_bad_samples_options():
    net = Detector()
    with pytest.raises(TypeError, match=r"samples must be True, False, or a list of the positions"):
        torchdp.DataParallel(net, devices=cpu_devices(2), samples="images")
    dp = torchdp.DataParallel(net, devices=cpu_devices(2), samples=["targets"])
    imgs, targets = images_and_targets(3)
    with pytest.raises(
        TypeError, match=r"samples names keyword argument 'targets', which is missing"
    ):
        dp(imgs)
    dp = torchdp.DataParallel(net, devices=cpu_devices(2), samples=True)
    with pytest.raises(
        ValueError,
        match=r"lists of samples have different lengths \(positional "
        r"argument 0 has 3, positional argument 1 has 2\)",
    ):
        dp(imgs, targets[:2])
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="samples and cuda_graphs cannot be combined"):
            torchdp.DataParallel(net.cuda(), device_ids=[0], samples=True, cuda_graphs=True)


def _detection_equal(got, ref):
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-4, msg=f"image {i} {key}")


@pytest.mark.parametrize(
    "builder", ["fasterrcnn_mobilenet_v3_large_320_fpn", "maskrcnn_resnet50_fpn"]
)
def test_torchvision_detection_eval_equals_one_device_per_image(builder):
    detection = pytest.importorskip("torchvision.models.detection")
    torch.manual_seed(4)
    model = getattr(detection, builder)(
        weights=None,
        weights_backbone=None,
        num_classes=5,
        min_size=96,
        max_size=128,
        box_score_thresh=0.0,
    ).eval()
    with torch.no_grad():  # untrained heads score everything alike; spread the scores
        for name, p in model.named_parameters():
            if "cls" in name:
                p.normal_(0, 0.5)
    dp = torchdp.DataParallel(model, devices=cpu_devices(2), samples=True)
    # Each device's images give what one device gives them, exactly. (torchvision's result for
    # an image depends on the batch it is in: images of different sizes are padded to the
    # largest, and an untrained model's near-equal scores turn on float noise, so the reference
    # is one device over the same batches.)
    for images in (
        [torch.rand(3, 96, 128) for _ in range(4)],
        [torch.rand(3, 96 + 16 * (i % 2), 128 - 8 * i) for i in range(4)],
    ):
        with torch.no_grad():
            got, ref = dp(images), model(images[:2]) + model(images[2:])
        assert len(got) == 4 and all(len(d["boxes"]) > 0 for d in ref)
        _detection_equal(got, ref)
    sized = images
    # Without samples the images are refused, not cut along their channels.
    with pytest.raises(ValueError, match="samples=True"):
        torchdp.DataParallel(model, devices=cpu_devices(4))(sized[:3])


def test_torchvision_retinanet_trains_with_the_loss_of_one_device():
    detection = pytest.importorskip("torchvision.models.detection")
    torch.manual_seed(5)
    model = detection.retinanet_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=4, min_size=96, max_size=128
    )
    for m in model.modules():  # batch statistics would differ per replica
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    ref = clone_module(model)
    images = [torch.rand(3, 96, 128) for _ in range(4)]
    targets = [
        {
            "boxes": torch.tensor([[4.0, 8.0, 40.0 + 8 * i, 60.0]] * (i + 1)),
            "labels": torch.ones(i + 1, dtype=torch.int64),
        }
        for i in range(4)
    ]
    dp = torchdp.DataParallel(model, devices=cpu_devices(2), samples=True)
    losses = dp(images, targets)
    expected = ref(images, targets)
    assert losses.keys() == expected.keys()
    total = sum(v.mean() for v in losses.values())  # two replicas of two images each
    torch.testing.assert_close(total, sum(expected.values()), rtol=1e-4, atol=1e-5)
    total.backward()
    sum(expected.values()).backward()
    grads = [
        (p.grad, q.grad)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
        if q.grad is not None
    ]
    assert grads
    for a, b in grads:
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
