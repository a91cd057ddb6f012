"""A user's reward, named on the command line as ``--reward package.module:factory[:WEIGHT]`` (docs/rewards.md,
"Adding a reward"). The contract is the simplest one: ``factory(**options)`` returns a callable
``scorer(images, prompts, **context) -> scores``, images ``(B, 3, H, W)`` float in [0, 1] on the reward's device,
one prompt per image, scores ``(B,)`` (or a dict with ``"score"`` and extra ``(B,)`` entries, logged as
``reward_<name>_<key>``). ``options`` are ``--reward_options KEY=VALUE ...``, plus ``device`` when the factory takes
a ``device`` argument."""
from __future__ import annotations

import inspect
import json
from typing import Any, Callable, Sequence

import torch

from fastvideo.plugins import load_object

PLUGIN_HELP = "docs/rewards.md (Adding a reward)"


def load_plugin(target: str) -> Callable[..., Any]:
    """The factory of ``package.module:factory``; ValueError naming --reward when it does not import or is not
    callable."""
    factory = load_object(target, "--reward", "factory", PLUGIN_HELP)
    if not callable(factory):
        raise ValueError(f"--reward {target!r}: {target.partition(':')[2]!r} is not callable; a reward factory "
                         f"returns a scorer (see {PLUGIN_HELP})")
    return factory


def parse_reward_options(options: Sequence[str] | dict | None) -> dict[str, Any]:
    """``--reward_options KEY=VALUE ...`` -> {key: value}; a value is read as JSON where it parses (numbers, true /
    false, null, lists, quoted strings), else kept as the string (a path). ValueError naming the bad entry."""
    if options is None:
        return {}
    if isinstance(options, dict):
        return dict(options)
    parsed: dict[str, Any] = {}
    for entry in options:
        key, sep, text = str(entry).partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"--reward_options {entry!r} is not KEY=VALUE with KEY a Python name (e.g. "
                             f"weights=/data/w.pt scale=2.0); see {PLUGIN_HELP}")
        if key.strip() in parsed:
            raise ValueError(f"--reward_options gives {key.strip()!r} twice; give each option once")
        try:
            value: Any = json.loads(text)
        except json.JSONDecodeError:
            value = text
        parsed[key.strip()] = value
    return parsed


def build_plugin(target: str, device: torch.device, options: dict[str, Any]) -> Callable[..., Any]:
    """``factory(**options)`` (with ``device=`` when the factory takes it): the scorer; ValueError naming the flag
    when the factory refuses the options or returns no callable."""
    factory = load_plugin(target)
    kwargs = dict(options)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        params = {}
    if "device" in params and "device" not in kwargs:
        kwargs["device"] = device
    try:
        scorer = factory(**kwargs)
    except TypeError as err:
        raise ValueError(f"--reward {target!r} does not take these --reward_options ({err}); pass the factory's "
                         f"keyword arguments as KEY=VALUE (see {PLUGIN_HELP})") from err
    if not callable(scorer):
        raise ValueError(f"--reward {target!r}: the factory returned a {type(scorer).__name__}, not a scorer; it "
                         f"must return a callable (images, prompts) -> scores (see {PLUGIN_HELP})")
    return scorer
