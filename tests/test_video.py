"""Video outputs and video rewards, family-free: image rewards over frames (``--frame_reduce``, ``--reward_frames``)
and the logged frame-change watch, frame strips, a real H.264 MP4 that PyAV decodes back, sample.py's per-sample
files, and recordings of videos (lossless frame stacks) replayed as the same tensors."""
from __future__ import annotations

import pytest
import torch

from fastvideo.logging import frame_strips, save_image_grid
from fastvideo.rewards import RewardFn, frame_index


def _brightness(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    return images.mean(dim=(1, 2, 3))


def _red(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    return images[:, 0].mean(dim=(1, 2))


def _ramp(frames: int, start: float, stop: float) -> torch.Tensor:
    """A (F, 3, 4, 4) video whose frame f is uniformly start + (stop - start) f / (F - 1), red channel doubled/2."""
    levels = torch.linspace(start, stop, frames)
    video = levels.view(frames, 1, 1, 1).expand(frames, 3, 4, 4).clone()
    video[:, 0] = video[:, 0] / 2
    return video


def test_frame_index_is_evenly_spaced_with_both_ends():
    assert frame_index(81, 0).tolist() == list(range(81))
    assert frame_index(81, 5).tolist() == [0, 20, 40, 60, 80]
    assert frame_index(5, 9).tolist() == [0, 1, 2, 3, 4]  # more than there are: all
    assert frame_index(81, 4, "first").tolist() == [0] and frame_index(81, 4, "last").tolist() == [80]
    with pytest.raises(ValueError, match="--frame_reduce must be one of mean, min, first, last"):
        frame_index(5, 0, "max")
    with pytest.raises(ValueError, match="--reward_frames must be >= 0"):
        frame_index(5, -1)


@pytest.mark.parametrize("reduce,frames", [("mean", 0), ("min", 0), ("first", 0), ("last", 0), ("mean", 3)])
def test_video_rewards_reduce_each_component_over_the_chosen_frames(reduce, frames):
    """Two components (weights 1 and 0.5) on videos whose frames are known grey levels: each component is the
    reduction of its per-frame scores, the total their weighted sum, and frame_change the mean step between frames."""
    videos = torch.stack([_ramp(5, 0.0, 1.0), _ramp(5, 1.0, 1.0)])  # a fade-in and a static white video
    fn = RewardFn([("bright", 1.0, _brightness), ("red", 0.5, _red)], frame_reduce=reduce, reward_frames=frames)
    out = fn(videos, ["a fade", "white"])
    levels = torch.linspace(0, 1, 5)
    picked = {"mean": levels[frame_index(5, frames)], "min": levels[:1], "first": levels[:1], "last": levels[-1:]}
    grey = picked[reduce]
    # per frame f at level g: brightness (g/2 + g + g) / 3 = 5g/6, red g/2
    fade_bright = {"mean": (5 * grey / 6).mean(), "min": (5 * grey / 6).min()}.get(reduce, 5 * grey[0] / 6)
    fade_red = {"mean": (grey / 2).mean(), "min": (grey / 2).min()}.get(reduce, grey[0] / 2)
    torch.testing.assert_close(out["bright"], torch.tensor([float(fade_bright), 5 / 6]))
    torch.testing.assert_close(out["red"], torch.tensor([float(fade_red), 0.5]))
    torch.testing.assert_close(out["total"], out["bright"] + 0.5 * out["red"])
    if reduce == "mean" and frames == 0:
        assert abs(float(out["bright"][0]) - 5 / 12) < 1e-6  # the fade's mean level is 0.5: 5/6 x 0.5
    # frame_change: the fade moves 1/4 per frame on the two grey channels and 1/8 on red, the white video never
    torch.testing.assert_close(out["frame_change"], torch.tensor([(0.25 + 0.25 + 0.125) / 3, 0.0]))
    assert "frame_change" not in fn.names  # logged beside the reward, never part of the total


def test_frame_change_is_the_mean_absolute_step_between_consecutive_frames():
    """A grey video going 0 -> 0.5 -> 0.25 (up, then back down): the steps are 0.5 and 0.25, so the watch is 0.375.
    From the first and last frames alone it would read 0.125 (0.25 over two steps), and without the absolute value
    the steps would cancel to 0.125; a video that flickers back to its first frame reads 0.5, not 0."""
    levels = [[0.0, 0.5, 0.25], [0.2, 0.7, 0.2]]
    videos = torch.tensor(levels).view(2, 3, 1, 1, 1).expand(2, 3, 3, 4, 4).contiguous()
    fn = RewardFn([("bright", 1.0, _brightness)])
    torch.testing.assert_close(fn(videos, ["a", "b"])["frame_change"], torch.tensor([0.375, 0.5]))
    torch.testing.assert_close(fn(videos[:, :1], ["a", "b"])["frame_change"], torch.zeros(2))  # one frame: no change


def test_images_still_score_as_before_and_bad_shapes_name_the_layout():
    fn = RewardFn([("bright", 1.0, _brightness)])
    images = torch.rand(3, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    out = fn(images, ["a"] * 3)
    assert set(out) == {"total", "bright"} and torch.equal(out["total"], images.mean(dim=(1, 2, 3)))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\) or videos \(B, F, 3, H, W\)"):
        fn(torch.rand(2, 4, 4), ["a", "b"])
    with pytest.raises(ValueError, match="2 videos but 1 prompts"):
        fn(torch.rand(2, 5, 3, 4, 4), ["a"])


def test_frame_strips_and_a_video_grid_row_per_video(tmp_path):
    videos = torch.stack([_ramp(17, 0, 1), _ramp(17, 1, 0)])
    strips = frame_strips(videos)
    assert strips.shape == (16, 3, 4, 4)  # 8 frames per video: 0, 2, 5, 7, 9, 11, 14, 16
    assert torch.equal(strips[0], videos[0, 0]) and torch.equal(strips[7], videos[0, 16])
    assert torch.equal(strips[8], videos[1, 0])
    grid = save_image_grid(videos, tmp_path / "g.png")
    assert grid.shape == (3, 2 * 6 + 2, 8 * 6 + 2) and (tmp_path / "g.png").is_file()  # 2 rows of 8, padding 2


def _moving_square(frames: int = 9, size: int = 32) -> torch.Tensor:
    video = torch.zeros(frames, 3, size, size)
    video[:, 2] = 0.25  # a blue-ish background
    for f in range(frames):
        video[f, 0, 8:16, 2 + 2 * f:10 + 2 * f] = 1.0  # a red square moving right by 2 px per frame
    return video


def test_mp4_is_written_and_decodes_back_to_the_frames(tmp_path):
    from fastvideo.video import read_mp4, write_mp4

    video = _moving_square()
    path = write_mp4(video, tmp_path / "v.mp4", fps=16)
    assert path.read_bytes()[4:8] == b"ftyp"  # an MP4 container
    frames, fps = read_mp4(path)
    assert frames.shape == video.shape and fps == 16
    error = (frames - video).abs()
    assert error.mean() < 0.02 and error.max() < 0.5, (error.mean(), error.max())  # H.264 at CRF 18: lossy, close
    # the square moves right: its red mass's column centre grows by ~2 px per frame in the decoded video too
    cols = torch.arange(32).float()
    red = (frames[:, 0] > 0.5).float()
    centre = (red.sum(dim=1) * cols).sum(dim=1) / red.sum(dim=(1, 2))
    torch.testing.assert_close(centre[1:] - centre[:-1], torch.full((8,), 2.0), atol=0.3, rtol=0)
    with pytest.raises(ValueError, match="even height and width"):
        write_mp4(torch.zeros(2, 3, 5, 6), tmp_path / "odd.mp4", fps=8)


def test_save_sample_writes_a_strip_png_and_an_mp4(tmp_path):
    from fastvideo.evaluation import save_sample
    from fastvideo.record import load_image
    from fastvideo.video import read_mp4

    video = _moving_square()
    files = save_sample(video, tmp_path, "p000000-s000.png", fps=8)
    assert files == {"path": "images/p000000-s000.png", "video": "videos/p000000-s000.mp4"}
    strip = load_image(tmp_path / files["path"])
    assert strip.shape == (3, 32 + 4, 8 * 34 + 2)  # one row of 8 frames, padding 2
    frames, fps = read_mp4(tmp_path / files["video"])
    assert frames.shape == (9, 3, 32, 32) and fps == 8
    image = torch.rand(3, 8, 8)
    assert save_sample(image, tmp_path, "img.png") == {"path": "images/img.png"}
    assert (load_image(tmp_path / "images" / "img.png") - image).abs().max() <= 0.5 / 255 + 1e-6


def test_recorded_videos_replay_as_the_same_8_bit_frames(tmp_path):
    from fastvideo.record import Recorder, Replay

    videos = torch.stack([_moving_square(5, 16), _moving_square(5, 16).flip(-1)])
    recorder = Recorder(tmp_path, rank=0)
    recorder.start({"seed": 1}, resume_step=0)
    recorder.add_samples(1, [0, 1], [0, 0], ["a", "b"], videos, {"total": torch.zeros(2)}, None)
    replay = Replay(tmp_path, images=True)
    back = replay.images(1, [0, 1], [0, 0], like=videos)
    assert back.shape == videos.shape
    assert (back - videos).abs().max() <= 0.5 / 255 + 1e-6  # 8-bit rounding only: a lossless frame stack
    with pytest.raises(ValueError, match="not 9 frames of 16"):
        replay.images(1, [0], [0], like=torch.zeros(1, 9, 3, 16, 16))


def test_tensorboard_gets_an_animated_gif_and_wandb_an_mp4_of_the_videos(tmp_path, monkeypatch):
    """``Logger.log_video``: TensorBoard's event file holds an image summary that is a GIF of every frame of the tiled
    videos (what its add_video writes, without moviepy); offline W&B logs a Video whose MP4 PyAV decodes to the
    frames."""
    import io

    import numpy as np

    from PIL import Image, ImageSequence
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fastvideo.logging import MetricsLogger, video_grid
    from fastvideo.video import read_mp4

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    videos = torch.zeros(2, 5, 3, 16, 16)
    for f in range(5):
        videos[:, f, 0, 4:8, 2 * f:2 * f + 4] = 1.0  # a red square moving right, 2 px per frame
    logger = MetricsLogger(tmp_path, enabled=True, sinks=("jsonl", "tensorboard", "wandb"), config={"x": 1})
    logger.log_video("videos", videos, 3, fps=8)
    logger.close()
    grid = video_grid(videos)
    assert grid.shape == (5, 3, 2 + 18, 2 + 2 * 18)  # two videos side by side, make_grid's 2 px padding
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    [event] = events.Images("videos")
    gif = Image.open(io.BytesIO(event.encoded_image_string))
    frames = [torch.from_numpy(np.asarray(f.convert("RGB"))) for f in ImageSequence.Iterator(gif)]
    assert event.step == 3 and gif.format == "GIF" and len(frames) == 5
    for f, frame in enumerate(frames):  # GIF's palette keeps these pure colours exact
        assert torch.equal(frame.permute(2, 0, 1).float() / 255, grid[f].mul(255).round().div(255)), f
    [mp4] = tmp_path.glob("samples/videos-step-000003.mp4")
    decoded, fps = read_mp4(mp4)
    assert decoded.shape == grid.shape and fps == 8 and (decoded - grid).abs().mean() < 0.05
    assert list((tmp_path / "wandb").glob("offline-run-*/files/media/videos/*.mp4"))
