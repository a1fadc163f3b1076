"""What an evaluation writes besides its metrics: per-image calibration maps and the plots of the
region views (ECE per boundary band and object size, risk-coverage, reliability per band)."""

from __future__ import annotations

from pathlib import Path

import torch

from cals_seg.data.transforms import eval_transform
from cals_seg.data.voc import voc_palette
from cals_seg.evaluation.inference import EvalProtocol, segment_logits
from cals_seg.utils.paths import check_id, inside
from cals_seg.visualization import plotting


@torch.no_grad()
def calibration_maps(
    model: torch.nn.Module,
    dataset,
    ids: list[str],
    out_dir: Path,
    device: torch.device,
    class_names: list[str],
    ignore_index: int,
    temperature: float = 1.0,
    protocol: EvalProtocol | None = None,
    amp: str = "none",
) -> list[Path]:
    """One six-panel PNG per image id, at the image's own resolution: the logits of the
    evaluation's ``protocol`` (:func:`cals_seg.evaluation.inference.segment_logits`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.eval()
    to_tensor = eval_transform(None, ignore_index=ignore_index)
    written = []
    for sample_id in ids:
        image, mask = dataset.load_image(sample_id), dataset.load_mask(sample_id)
        x = to_tensor(image=image, mask=mask)["image"].unsqueeze(0).to(device)
        logits = segment_logits(model, x, protocol, amp) / temperature
        conf, pred = logits.softmax(dim=1).max(dim=1)
        path = inside(out_dir, check_id(f"{sample_id}.png", f"calibration map of {sample_id!r}"),
                      "eval_seg --num-maps")  # an id never writes outside the maps folder
        path.parent.mkdir(parents=True, exist_ok=True)
        plotting.plot_calibration_map(
            image,
            mask,
            pred[0].cpu().numpy(),
            conf[0].cpu().numpy(),
            path,
            class_names=class_names,
            ignore_index=ignore_index,
            palette=voc_palette(),
            title=sample_id,
        )
        written.append(path)
    return written


def plot_regions(result: dict, out: Path, name: str) -> list[Path]:
    """ECE per boundary band and per object size, risk-coverage, reliability per band (pre-,
    post-TS and every post-hoc calibrator of ``result["calibrators"]``)."""
    result = {**result, **{f"cal_{k}": v for k, v in (result.get("calibrators") or {}).items()}}
    views = [(key, key.replace("_", "-").replace("ts", "TS")) for key in ("pre_ts", "post_ts")
             if result.get(key)]  # fmt: skip
    views += [(key, key[4:]) for key in result if key.startswith("cal_")]
    pre = result["pre_ts"]
    written = []
    for group, what, xlabel in (
        ("band", "boundary band", "distance to the nearest class boundary (pixels)"),
        ("size", "object size", "area of the ground-truth object (pixels)"),
    ):
        if pre.get(f"ece_{group}") is None:
            continue
        path = out / f"ece_{group}s.png"
        plotting.plot_band_ece(
            pre[f"{group}_edges"], {label: result[k][f"ece_{group}"] for k, label in views},
            path, title=f"{name}: ECE per {what}", xlabel=xlabel, counts=pre[f"count_{group}"],
        )
        written.append(path)
    if pre.get("risk_coverage"):
        path = out / "risk_coverage.png"
        curves = [(label, result[k]["risk_coverage"], result[k]["aurc"]) for k, label in views]
        plotting.plot_risk_coverage(curves, path, title=f"{name}: risk-coverage")
        written.append(path)
    for key, label in views if pre.get("reliability_band") else []:
        bands = zip(plotting.band_labels(pre["band_edges"]), result[key]["reliability_band"],
                    strict=True)  # fmt: skip
        items = [(f"{label}, d in {b}", rel) for b, rel in bands]
        path = out / f"reliability_bands_{key.removeprefix('cal_')}.png"
        plotting.plot_reliability_grid(items, path, ncols=len(items))
        written.append(path)
    return written
