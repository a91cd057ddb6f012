"""The flag layer: options dataclass groups -> argparse (``build_parser``), the --config files and the layers a command
line stacks (``parse_with_config``), the pairs of flags refused together (``EXCLUSIONS``), config.json, and the checks
that span components (``validate_common``: paths, the model folder, parallelism, logging and checkpoint ranges).

Each component owns its options dataclass beside the code that reads it (``rollout.SamplingOptions``,
``rewards.RewardOptions``, ``parallel.ParallelOptions``, ...) and each objective its own (``objectives.py``, which also
assembles the trainers' parsers and validators). Flag names follow DanceGRPO where the concept exists. Every flag has a
help text with its unit; a bad value raises ``ValueError`` naming the flag and the fix before any model loads.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from fastvideo import models, parallel, weights
from fastvideo.evaluation import check_prompts_path
from fastvideo.models.attention import check_attention_backend
from fastvideo.options import need
from fastvideo.rewards import check_url_reward_flags, parse_eval_reward_spec
from fastvideo.rollout import changed_flags, fill_family_sampling


def _add_group(parser: argparse.ArgumentParser, cls: type, help_overrides: dict[str, str] | None = None,
               default_overrides: dict[str, Any] | None = None, exclude: Sequence[str] = ()) -> None:
    group = parser.add_argument_group(cls.__name__.replace("Options", "").lower())
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        meta = dict(f.metadata)
        help_text = (help_overrides or {}).get(f.name, meta["help"])
        meta.pop("help")
        flag = f"--{f.name}"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        default = (default_overrides or {}).get(f.name, default)
        if f.type in ("bool", bool, "bool | None"):  # a switch; "bool | None": unset (None) means auto
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        if "type" not in meta and "nargs" not in meta:
            meta["type"] = _scalar_type(f.type)
        elif "nargs" in meta and "type" not in meta:
            meta["type"] = str
        group.add_argument(flag, default=default, help=f"{help_text} (default: {default})", **meta)


def _scalar_type(annotation: Any):
    text = str(annotation)
    if "int" in text and "float" not in text:
        return int
    if "float" in text:
        return float
    return str


class FlagParser(argparse.ArgumentParser):
    """argparse, with a bad flag reported in one line (``PROG: error: ...``, exit status 2) instead of the usage text
    (hundreds of flags for a trainer), printed by rank 0 only under torchrun."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if os.environ.get("RANK", "0") == "0":
            print(f"{self.prog}: error: {message} (--help lists the flags)", file=sys.stderr, flush=True)
        raise SystemExit(2)


def build_parser(groups: Sequence[type], description: str, help_overrides: dict[str, str] | None = None,
                 default_overrides: dict[str, Any] | None = None, exclude: Sequence[str] = ()
                 ) -> argparse.ArgumentParser:
    """An argparse parser with one argument group per dataclass in ``groups`` (``help_overrides`` /
    ``default_overrides``: flag -> the help text / default a trainer needs instead of the shared one; ``exclude``:
    flags of those groups a tool does not read) and ``--config FILE`` (read by ``parse_with_config``)."""
    parser = FlagParser(description=description)
    add_config_flag(parser)
    for cls in groups:
        _add_group(parser, cls, help_overrides, default_overrides, exclude)
    return parser


# ------------------------------------------------------------------------------------------------ config files
# keys a trainer's OUT/config.json holds besides its flags (so that the file can be passed back with --config)
RECORDED_KEYS = ("algorithm", "batch_arithmetic", "config")


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """``--config FILE``: flag values from a YAML or JSON file; flags on the command line override them."""
    parser.add_argument("--config", default=None, metavar="FILE", action="append",
                        help="YAML or JSON file of flag values (keys are flag names without --, e.g. learning_rate: "
                             "1.0e-5; lists for multi-value flags, true/false for switches, null for the default); "
                             "flags given on the command line override it. Repeatable: a later file overrides an "
                             "earlier one, and a value that conflicts with a later layer's flag (e.g. "
                             "--timestep_fraction under --sde_window_size) is dropped with a note. A run's "
                             "OUT/config.json reproduces the run; scripts/recipes/ holds the recipes (FLUX.1-dev, SD3.5-M, "
                             "Qwen-Image, FLUX.2-klein), "
                             "scripts/demos/ the demos' values")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML (.yaml/.yml, or anything not .json) or JSON file (FileNotFoundError / ValueError)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such file; pass a YAML or JSON file of flag values (a run's "
                                "OUT/config.json, or one of scripts/recipes/*.yaml)")
    text = path.read_text()
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml  # optional: only for YAML --config files

            data = yaml.safe_load(text)
    except Exception as err:  # json.JSONDecodeError or yaml.YAMLError: both name the line
        raise ValueError(f"--config {path} does not parse: {err}") from err
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of flag name -> value, got a {type(data).__name__}")
    return data


def config_tokens(parser: argparse.ArgumentParser, data: dict[str, Any], source: str) -> list[str]:
    """Command-line tokens equivalent to the config mapping ``data`` (so argparse applies its types and choices);
    ``null`` values become parser defaults. ValueError for keys that are no flag of this parser (with the nearest
    flag names), for a config written by another trainer, and for values of the wrong shape."""
    import difflib  # only for a misspelt key's suggestion

    mine = parser.get_default("algorithm")
    if data.get("algorithm") not in (None, mine):
        raise ValueError(f"--config {source} was written by the {str(data['algorithm']).upper()} trainer; pass it to "
                         f"that trainer, or remove its 'algorithm' key to reuse its flags here")
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    unknown = [k for k in data if k.lstrip("-") not in actions and k not in RECORDED_KEYS]
    if unknown:
        hints = [f"{k} (did you mean {', '.join(m)}?)" if (m := difflib.get_close_matches(k, actions, n=2)) else k
                 for k in unknown]
        raise ValueError(f"--config {source}: unknown flag name(s) {'; '.join(hints)}; fix or remove them (keys are "
                         "this script's flag names without --: see --help)")
    tokens: list[str] = []
    for key, value in data.items():
        key = key.lstrip("-")
        if key in RECORDED_KEYS:
            continue
        action = actions[key]
        flag = action.option_strings[0]
        if value is None:
            parser.set_defaults(**{key: None})
        elif isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ValueError(f"--config {source}: {key} is a switch; give true or false, not {value!r}")
            tokens.append(flag if value else f"--no-{key}")
        elif action.nargs is not None:
            values = list(value) if isinstance(value, (list, tuple)) else [value]
            if not values:
                raise ValueError(f"--config {source}: {key} needs at least one value (or null for the default)")
            tokens += [flag, *(str(v) for v in values)]
        else:
            if isinstance(value, (list, tuple, dict)):
                raise ValueError(f"--config {source}: {key} takes one value, got {value!r}")
            tokens.append(f"{flag}={value}")
    return tokens


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default: sys.argv) with the flags of each ``--config FILE`` in front, in order, so that a later
    file overrides an earlier one and the command line overrides them all; the file paths stay in ``args.config`` (a
    list). Where a lower layer's value conflicts with a higher layer's flag (``EXCLUSIONS``), the lower one yields:
    it is reset to its default and a note says so (``resolve_layer_conflicts``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None, action="append")
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return parser.parse_args(argv)
    layers = [(f"--config {path}", config_tokens(parser, read_config_file(path), path)) for path in known.config]
    layers.append(("the command line", argv))
    args = parser.parse_args([token for _, tokens in layers for token in tokens])
    for note in resolve_layer_conflicts(parser, args, layers):
        if os.environ.get("RANK", "0") == "0":
            print(f"note: {note}", file=sys.stderr, flush=True)
    return args


def flags_given(parser: argparse.ArgumentParser, tokens: Sequence[str]) -> set[str]:
    """The flag names (dests) that ``tokens`` set explicitly, however spelled (``--h 64``, ``--h=64``, a prefix) and
    whatever their values: parsed into a namespace that already holds a marker for every flag, where argparse leaves
    the marker for each flag not given (it only fills in defaults of attributes the namespace lacks)."""
    unset = object()
    dests = {a.dest for a in parser._actions if a.dest not in ("help", "config")}  # --config appends: no marker
    given, _ = parser.parse_known_args(list(tokens), argparse.Namespace(**dict.fromkeys(dests, unset)))
    return {k for k in dests if getattr(given, k) is not unset}


@dataclass(frozen=True)
class Exclusion:
    """Two flags a validator refuses together: ``clash(args, defaults)`` says whether their values do."""

    a: str
    b: str
    clash: Callable[[argparse.Namespace, dict[str, Any]], bool]


# Every pair of flags that validate_common / validate_sampling / validate_grpo / validate_dpo / validate_nft /
# validate_sample refuse together (tests/test_flag_layers.py checks each is refused on one command line and yields
# across layers). DPO's offline mode (--preference_file) excludes each of its online-only flags.
DPO_ONLINE_ONLY = ("num_generations", "reward", "min_reward_gap", "sampler", "eta", "sde_type", "sde_window_size",
                   "sde_window_range", "sde_window_schedule", "sde_window_shift_interval", "sde_window_stride",
                   "init_same_noise", "decode_x0", "last_step", "replay_images", "reward_overlap")
EXCLUSIONS: tuple[Exclusion, ...] = (
    Exclusion("sde_window_size", "timestep_fraction",
              lambda a, d: a.sde_window_size > 0 and a.timestep_fraction is not None),
    Exclusion("sde_window_size", "sde_window_range",
              lambda a, d: a.sde_window_size == 0 and bool(changed_flags(a, ("sde_window_range",), d))),
    Exclusion("last_step", "sde_window_range",
              lambda a, d: a.last_step == "ode" and a.sde_window_size > 0 and a.sde_window_range is not None
              and a.sde_window_range[1] == a.sampling_steps),
    Exclusion("kl_beta", "sde_window_range",  # GRPO: CPS has no KL at its last step (sigma' = 0)
              lambda a, d: getattr(a, "sde_type", None) == "cps" and a.kl_beta > 0 and a.sde_window_size > 0
              and a.sde_window_range is not None and a.sde_window_range[1] == a.sampling_steps),
    Exclusion("lr_scheduler", "lr_warmup_steps", lambda a, d: a.lr_scheduler == "constant" and a.lr_warmup_steps > 0),
    Exclusion("fsdp_version", "gradient_sync", lambda a, d: a.fsdp_version == 1 and a.gradient_sync == "step"),
    Exclusion("fsdp_version", "sp_size", lambda a, d: a.fsdp_version == 1 and a.sp_size > 1),
    Exclusion("sampler", "eta", lambda a, d: a.sampler == "ode" and a.eta not in (None, 0.0)),
    Exclusion("sampler", "sde_window_size", lambda a, d: a.sampler == "ode" and a.sde_window_size > 0),
    Exclusion("sampler", "init_same_noise", lambda a, d: a.sampler == "ode" and a.init_same_noise),
    *(Exclusion("preference_file", key, lambda a, d, key=key: a.preference_file is not None
                and bool(changed_flags(a, (key,), d)))
      for key in DPO_ONLINE_ONLY),
    Exclusion("lora_path", "transformer_path", lambda a, d: a.lora_path is not None and a.transformer_path is not None),
)


def _shown(args: argparse.Namespace, key: str) -> str:
    value = getattr(args, key)
    if isinstance(value, bool):
        return f"--{key}" if value else f"--no-{key}"
    if isinstance(value, (list, tuple)):
        return f"--{key} {' '.join(map(str, value))}"
    return f"--{key} {value}"


def resolve_layer_conflicts(parser: argparse.ArgumentParser, args: argparse.Namespace,
                            layers: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """Let a lower layer's value yield where it conflicts with a higher layer's flag (``EXCLUSIONS``): e.g. a demo's
    ``--sde_window_size 2`` (its --config file) under the user's ``--timestep_fraction 0.5`` is reset to its default,
    and then the demo's ``--sde_window_range``, which needs a size. Conflicts within one layer are left to the
    validators (an error naming both flags). Returns the notes to print."""
    dests = {a.dest for a in parser._actions}
    origin: dict[str, int] = {}  # flag -> index of the highest layer that sets it
    for index, (_, tokens) in enumerate(layers):
        for key in flags_given(parser, tokens):
            origin[key] = index
    defaults = {key: parser.get_default(key) for key in dests}
    notes = []
    reset: set[str] = set()  # values reset by a drop: they count as the dropping layer's, so a lower layer's value
    changed = True           # that clashes with the reset one is dropped too (a demo's --sde_window_range once its
    while changed:           # --sde_window_size yields to the user's --timestep_fraction)
        changed = False
        for ex in EXCLUSIONS:
            if ex.a not in dests or ex.b not in dests or ex.a not in origin or ex.b not in origin:
                continue
            if origin[ex.a] == origin[ex.b] or not ex.clash(args, defaults):
                continue
            low, high = (ex.a, ex.b) if origin[ex.a] < origin[ex.b] else (ex.b, ex.a)
            if low in reset:  # already at its default: the validators name what still clashes
                continue
            by = "reset above" if high in reset else f"from {layers[origin[high]][0]}"
            notes.append(f"{_shown(args, low)} (from {layers[origin[low]][0]}) dropped: {_shown(args, high)} ({by}) "
                         f"excludes it")
            setattr(args, low, defaults[low])
            origin[low] = origin[high]
            reset.add(low)
            changed = True
    return notes


def field_defaults(groups: Sequence[type]) -> dict[str, Any]:
    """flag name -> default value over ``groups`` (to tell which flags a user changed)."""
    return {f.name: f.default for cls in groups for f in dataclasses.fields(cls)}


def save_config(config: argparse.Namespace | dict, path: str | Path) -> None:
    """Write every flag (a Namespace or dict) to ``path`` as JSON: what the run actually used."""
    config = vars(config) if isinstance(config, argparse.Namespace) else config
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")


def _check_manifest(flag: str, path: str | None, model: Path, prompts: str) -> None:
    """FileNotFoundError naming the preprocessing command when ``path`` (a manifest or its folder) has no manifest."""
    if path is None:
        return
    data = Path(path)
    manifest = data / "manifest.json" if data.is_dir() else data
    if not manifest.is_file():
        raise FileNotFoundError(f"{flag} {data}: no manifest.json; run preprocess_embeddings.py --model_path {model} "
                                f"--prompt_file {prompts} --output_dir {data} first")


def _check_negative(args: argparse.Namespace) -> None:
    """--cfg_scale > 1 (set, or the family's default) needs the negative prompt's embeddings in the store: said
    before anything loads (the dataset would refuse it only after the model is up)."""
    if args.cfg_scale <= 1:
        return
    for flag, path in (("--data_json_path", args.data_json_path), ("--eval_prompts", args.eval_prompts)):
        if path is None or not str(path).endswith("json") and not Path(path).is_dir():
            continue  # --eval_prompts may be a prompt file, encoded with the run's own negative prompt
        manifest = Path(path) / "manifest.json" if Path(path).is_dir() else Path(path)
        if manifest.is_file() and not json.loads(manifest.read_text()).get("negative"):
            raise ValueError(f"--cfg_scale {args.cfg_scale:g} (classifier-free guidance) needs the negative prompt's "
                             f"embeddings, which {flag} {path} does not hold: re-run preprocess_embeddings.py with "
                             "--negative_prompt \"\" (or the family's negative prompt) into the same --output_dir "
                             "(finished shards are kept), or pass --cfg_scale 1 to train CFG-free")


def check_parallel_inputs(args: argparse.Namespace) -> None:
    """--sp_size (diffusers support, heads and image tokens divisible; FSDP2), --attention_backend (a diffusers
    backend name) and --peak_tflops, from the configs alone; the world size is checked at launch."""
    check_attention_backend(args.attention_backend)
    need(args.peak_tflops >= 0, f"--peak_tflops must be >= 0 (0 = auto), got {args.peak_tflops}")
    need(args.dist_timeout_minutes > 0, f"--dist_timeout_minutes must be > 0, got {args.dist_timeout_minutes}")
    need(args.sp_size >= 1, f"--sp_size must be >= 1 (1 = no sequence parallelism), got {args.sp_size}")
    if args.sp_size == 1:
        return
    need(args.fsdp_version == 2, f"--sp_size {args.sp_size} needs --fsdp_version 2 (FSDP2 shards over the dp x sp "
                                  "ranks under diffusers' context-parallel hooks)")
    model = Path(args.pretrained_model_name_or_path)
    family = models.family_for(args)
    config = json.loads((family.transformer_folder(model) / "config.json").read_text())
    from fastvideo.memory import condition_size  # an edit store's source size, as the planner reads it

    geometry = models.geometry_for(family, model, args.h, args.w, getattr(args, "num_frames", None),
                                   condition=condition_size(args, family))
    # an edit's source tokens join the split sequence
    parallel.check_sequence_parallel(args.sp_size, config["num_attention_heads"],
                                     geometry.seq_len + getattr(geometry, "condition_tokens", 0))


def check_model_inputs(args: argparse.Namespace) -> None:
    """What the model folder must hold for these flags, read from headers and configs only (no weights): the
    transformer's and VAE's safetensors are complete (ValueError naming a corrupt or truncated file), and every
    --lora_target_modules entry names a layer of the transformer (checked on a meta-device build). A component
    folder that is absent is left to its loader."""
    model = Path(args.pretrained_model_name_or_path)
    for component in ("transformer", "transformer_2", "vae"):  # transformer_2: Wan2.2-A14B's second expert
        if (model / component).is_dir():
            weights.check_weight_files(model / component)
    if args.lora_rank > 0 and args.lora_target_modules and (model / "transformer" / "config.json").is_file():
        from fastvideo import lora  # peft: only for a LoRA run

        lora.check_target_modules(models.family_for(args).build_transformer(model), args.lora_target_modules)


def validate_common(args: argparse.Namespace) -> None:
    """Checks shared by all trainers: paths exist, numbers are in range."""
    need(args.pretrained_model_name_or_path is not None,
         "--pretrained_model_name_or_path is required: a local diffusers model folder "
         "(or run scripts/finetune_flux_grpo.sh without MODEL_PATH for the tiny demo)")
    model = Path(args.pretrained_model_name_or_path)
    if not (model / "model_index.json").is_file():
        raise FileNotFoundError(f"--pretrained_model_name_or_path {model}: no model_index.json there; point it at "
                                "a local diffusers model folder (e.g. a FLUX.1-dev or Qwen-Image snapshot)")
    family = models.family_for(args)  # --model_family: ValueError naming the choices, before anything reads the folder
    need(args.sp_size == 1 or family.sequence_parallel,
         f"--sp_size {args.sp_size}: sequence parallelism is not implemented for the {family.name} "
         "family (FLUX.1, FLUX.1-Kontext and Wan have it); run it with --sp_size 1 and shard with FSDP")
    fill_family_sampling(args)  # unset --h/--w/--sampling_steps/--cfg_scale/--guidance_scale: the family's defaults
    dry_run = args.dry_run  # a plan needs no embeddings (512 text tokens are assumed)
    need(args.data_json_path is not None or dry_run,
         "--data_json_path is required: the manifest.json written by preprocess_embeddings.py")
    if not dry_run:
        _check_manifest("--data_json_path", args.data_json_path, model, "PROMPTS")
        _check_negative(args)
        check_prompts_path("--eval_prompts", args.eval_prompts)
    need(args.reward_batch_size >= 0, f"--reward_batch_size must be >= 0 (0 = one call), got {args.reward_batch_size}")
    check_url_reward_flags(args)
    need(args.dry_run_world_size is None or args.dry_run_world_size >= 1,
         f"--dry_run_world_size must be >= 1, got {args.dry_run_world_size}")
    need(args.max_train_steps >= 1, f"--max_train_steps must be >= 1, got {args.max_train_steps}")
    need(args.max_train_seconds >= 0, f"--max_train_seconds must be >= 0 (0 = no limit), got {args.max_train_seconds}")
    need(args.learning_rate >= 0, f"--learning_rate must be >= 0, got {args.learning_rate}")
    need(args.lr_warmup_steps >= 0, f"--lr_warmup_steps must be >= 0, got {args.lr_warmup_steps}")
    need(not (args.lr_warmup_steps and args.lr_scheduler == "constant"),
         f"--lr_warmup_steps {args.lr_warmup_steps} does nothing with --lr_scheduler constant; use "
         "--lr_scheduler constant_with_warmup (the default) or drop --lr_warmup_steps")
    need(args.lora_rank >= 0, f"--lora_rank must be >= 0 (0 = full fine-tune), got {args.lora_rank}")
    experts = (model / "transformer_2" / "config.json").is_file()
    need(args.train_experts == "both" or experts,
         f"--train_experts {args.train_experts} picks one of Wan2.2-A14B's two experts, but {model} has one "
         "transformer: drop the flag")
    need(args.train_experts == "both" or args.lora_rank == 0,
         f"--train_experts {args.train_experts}: LoRA trains both experts (their adapters are small); pass "
         "--lora_rank 0 for a full fine-tune of one expert, or drop the flag")
    check_model_inputs(args)
    check_parallel_inputs(args)
    if hasattr(args, "gradient_sync"):
        parallel.resolve_gradient_sync(args.gradient_sync, args.lora_rank > 0)
        need(not (args.gradient_sync == "step" and args.fsdp_version == 1),
             "--gradient_sync step does nothing with --fsdp_version 1 (FSDP1 reduces after every backward); use "
             "--fsdp_version 2 or drop the flag")
    need(args.checkpointing_steps >= 1, f"--checkpointing_steps must be >= 1, got {args.checkpointing_steps}")
    need(args.checkpoints_total_limit is None or args.checkpoints_total_limit >= 1,
         f"--checkpoints_total_limit must be >= 1, got {args.checkpoints_total_limit}")
    need(args.max_consecutive_skips >= 0,
         f"--max_consecutive_skips must be >= 0 (0 = never stop), got {args.max_consecutive_skips}")
    need(args.sample_every >= 0, f"--sample_every must be >= 0, got {args.sample_every}")
    need(args.eval_every >= 0, f"--eval_every must be >= 0 (0 = first and last step only), got {args.eval_every}")
    need(args.eval_max_prompts >= 0, f"--eval_max_prompts must be >= 0 (0 = all), got {args.eval_max_prompts}")
    need(args.eval_num_images >= 1, f"--eval_num_images must be >= 1, got {args.eval_num_images}")
    if args.eval_reward:
        parse_eval_reward_spec(args.eval_reward, args.reward)
        need(args.eval_prompts is not None, f"--eval_reward {args.eval_reward} scores the held-out evaluation: pass "
                                             "--eval_prompts too, or drop --eval_reward")
    need(0.0 < args.ema_decay < 1.0, f"--ema_decay must be in (0, 1), got {args.ema_decay}")
    need(args.train_batch_size >= 1, f"--train_batch_size must be >= 1, got {args.train_batch_size}")
    need(args.gradient_accumulation_steps >= 0,
         f"--gradient_accumulation_steps must be >= 0, got {args.gradient_accumulation_steps}")
    need(args.record_every >= 1, f"--record_every must be >= 1, got {args.record_every}")
    need(not args.replay_images or args.replay_dir is not None,
         "--replay_images takes the images of a recording: pass --replay_dir DIR too")
    if args.resume_from not in (None, "latest"):
        path = Path(args.resume_from)
        if not path.is_dir():
            raise FileNotFoundError(f"--resume_from {path}: no such checkpoint folder; use 'latest' or a path "
                                    "like OUTPUT_DIR/checkpoints/step-N")


