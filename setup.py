"""Packaging for the flow-matching RL suite (import name: ``fastvideo``)."""
from setuptools import find_packages, setup

setup(
    name="flowrl-fastvideo",
    version="0.1.0",
    description="GRPO, Diffusion-DPO and DiffusionNFT post-training for FLUX flow-matching models",
    packages=find_packages(include=["fastvideo", "fastvideo.*"]),
    # the pretrained toy FLUX (weights/), toy Wan (weights_video/) and toy Kontext (weights_edit/)
    package_data={"fastvideo.toyworld": ["weights/*.json", "weights/*/*", "weights_video/*.json", "weights_video/*/*",
                                         "weights_edit/*.json", "weights_edit/*/*"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6,<=2.14.1",
        "torchvision",
        "diffusers>=0.32",
        "transformers>=4.46",
        "peft>=0.13",
        "safetensors",
        "open_clip_torch>=2.24",
        "numpy",
        "pillow",
        "tqdm",
        "matplotlib",  # plots: python -m fastvideo.plot / fastvideo.compare, OUT/plots.png; imported only there
        "pyyaml",  # --config FILE.yaml
    ],
    extras_require={
        # the logging backends are in the test extra so that CI checks what they receive
        "test": ["pytest>=7.4", "pytest-timeout", "tensorboard", "wandb", "fastapi", "uvicorn", "av"],
        "video": ["av"],  # MP4s of video families' samples (PyAV bundles its FFmpeg)
        "serve": ["fastapi", "uvicorn"],  # python -m fastvideo.rewards.serve (the remote:URL client needs nothing)
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
    },
)
