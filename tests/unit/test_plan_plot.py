"""``meshrun plan --plot``: the PNG is written and holds the two panels; the scaling points."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from meshrun.cli.main import main
from meshrun.plan.cost import GB, Cluster, Model, Training
from meshrun.plan.plot import node_counts, scaling

pytest.importorskip("matplotlib")

SHAPE = [
    "--layers",
    "24",
    "--hidden",
    "2048",
    "--heads",
    "16",
    "--vocab",
    "50257",
    "--seq",
    "2048",
    "--global-batch",
    "256",
    "--gpu",
    "a100-80gb",
]


def test_plot_writes_a_png_of_the_layouts_and_the_scaling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "plan.png"
    assert main(["plan", *SHAPE, "--nodes", "4", "--plot", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # two drawn panels
    from matplotlib.image import imread

    pixels = imread(str(png))
    assert pixels.shape[:2] == (450, 1200)
    assert pixels[..., :3].std() > 0.05  # not a blank canvas


def test_plot_needs_a_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "none.png"
    assert main(["plan", "--params", "7.5e9", "--plot", str(png)]) == 2
    assert "--plot draws step times" in capsys.readouterr().err and not png.exists()


def test_scaling_points_follow_the_node_counts() -> None:
    assert node_counts(1) == [1] and node_counts(6) == [1, 2, 4, 6]
    m = Model(layers=24, hidden=2048, heads=16, vocab=50257, seq=2048)
    c = Cluster(8, 8, 80 * GB, 312e12, 300e9, 25e9)
    points = scaling(m, Training(global_batch=256), c, [1, 2, 4], ["none", "full"])
    assert [p.nodes for p in points] == [1, 2, 4, 8]
    assert points[0].efficiency == pytest.approx(1.0)
    assert all(p.tokens_per_s > 0 and 0 < p.efficiency <= 1.5 for p in points)
    # More GPUs, more tokens/s (the global batch is kept, so each GPU works on less).
    assert all(b.tokens_per_s > a.tokens_per_s for a, b in itertools.pairwise(points))
