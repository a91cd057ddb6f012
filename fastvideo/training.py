"""The run scaffold the trainers share (``start_run`` -> ``Run``): the checks before anything loads, the models, resume,
reward scoring and its failure agreement, evaluation, the optimizer step, metrics, checkpoints and the export.

Each trainer script keeps only its algorithm; the policy (``policy.py``), the launch gates (``launch.py``) and resume
compatibility (``resume.py``) are their own modules.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from fastvideo import checkpoint as ckpt
from fastvideo import devices, errors, evaluation, flops, models, parallel, preemption, record
from fastvideo import distributed as D
from fastvideo.advantages import group_advantages, nonzero_selection, share_samples, shuffle_order
from fastvideo.config import save_config
from fastvideo.data import EmbeddingDataset
from fastvideo.devices import compute_dtype
from fastvideo.evaluation import prompt_manifest
from fastvideo.launch import (check_memory_flags, check_memory_plan, check_output_dir, resolve_device_defaults,
                              with_sp_counts)
from fastvideo.logging import MetricsLogger, current_memory_gb, peak_memory_gb, progress_bar, save_image_grid
from fastvideo.options import take_default_notes
from fastvideo.plot import plot_runs
from fastvideo.policy import Policy, build_lr_scheduler, build_optimizer, build_policy, export_final
from fastvideo.prompt_groups import GroupSampler
from fastvideo.resume import (check_resume_checkpoint, check_resume_step, load_state, resolve_resume, run_config,
                              run_identity, save_state)
from fastvideo.rewards import (REWARD_PATH_FLAGS, build_reward, check_reward_paths, check_reward_prompts,
                               display_values, parse_reward_spec)
from fastvideo.rewards.overlap import OverlapScorer
from fastvideo.rollout import RolloutConfig, fill_family_sampling
from fastvideo.seeding import NoiseSource, derive_seed, rng_state, seed_all, set_rng_state


class RewardFailed(RuntimeError):
    """The reward raised on some rank while scoring samples; raised on every rank alike (``Run.gather_rewards``), with
    the failing rank and its error in the message."""


@dataclass
class PendingRewards:
    """One rollout's scoring under --reward_overlap (``Run.pending_rewards``): ``rollout`` calls it with each decoded
    micro-batch (its positions ``mb`` in the rank's batch and its images), and it hands this rank's ``share`` of them
    with their prompts to the scorer's thread and returns at once; ``Run.score_rollout`` joins the scores."""

    scorer: Any  # rewards.overlap.OverlapScorer
    prompts: list[str]  # this rank's, in sample order
    share: slice  # the positions this rank scores (its sequence-parallel group's share; all without --sp_size)
    mine: int  # how many of the scores it sends (0: an empty share scored one image for the reward's keys)
    sources: torch.Tensor | None = None  # an edit run's source images, this rank's, in sample order

    def __call__(self, mb: slice, images: torch.Tensor) -> None:
        """Submit the images of micro-batch ``mb`` that lie in this rank's share (with their sources)."""
        lo, hi = max(mb.start, self.share.start), min(mb.stop, self.share.stop)
        if lo < hi:
            part = (images[lo - mb.start:hi - mb.start], self.prompts[lo:hi])
            if self.sources is None:
                self.scorer.submit(*part)
            else:
                self.scorer.submit(*part, self.sources[lo:hi])


@dataclass
class Run:
    """Everything a trainer sets up the same way, in the order it must happen (``start_run`` -> ``load_models`` ->
    ``resume`` -> per step ``optimizer_step`` / ``end_step`` -> ``finish``), so each script keeps only its algorithm.

    ``state`` holds the trainer's resumable objects with ``state_dict``/``load_state_dict`` (e.g. the sampler), given
    to ``resume``; they are checkpointed with the model, optimizer, schedule, EMA, step and every rank's RNG state.
    """

    args: argparse.Namespace
    dist: D.DistInfo
    counts: dict[str, int]
    config: dict
    resume_dir: Path | None
    noise: Any
    amp_dtype: torch.dtype | None
    state: dict[str, Any] = field(default_factory=dict)
    reward_fn: Callable | None = None
    scorer: Any = None  # rewards.overlap.OverlapScorer of --reward's RewardFn with --reward_overlap, else None
    eval_reward_fn: Callable | None = None  # RewardFn of --eval_reward (held-out evaluation only), or None
    policy: Policy | None = None
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None
    vae: torch.nn.Module | None = None
    sync_every_backward: bool = True
    memory_baseline: float = 0.0
    start_step: int = 0
    skipped_updates: int = 0
    logger: Any = None
    bar: Any = None
    geometry: Any = None
    rollout_cfg: RolloutConfig | None = None  # the sampler's settings, built once by sampling_inputs
    eval_dataset: Any = None  # EmbeddingDataset of --eval_prompts
    dataset: Any = None  # EmbeddingDataset of --data_json_path (``sampling_inputs``)
    train_seconds: float = 0.0  # wall-clock of training steps so far (evaluation excluded; resumed from checkpoints)
    step_started: float = 0.0
    consecutive_skips: int = 0  # updates skipped in a row (non-finite gradient norm); see --max_consecutive_skips
    dropped_samples: int = 0  # samples dropped for a non-finite reward so far (--nonfinite_reward drop)
    preempted: tuple[int, str] | None = None  # (step, signal) when a stop signal ended the run early
    recorder: Any = None  # record.Recorder with --record_dir
    replay: Any = None  # record.Replay with --replay_dir
    step_grad_norms: list[float] = field(default_factory=list)  # this step's optimizer steps (for the recording)

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def out(self) -> Path:
        return Path(self.args.output_dir)

    def sampling_inputs(self) -> tuple[Any, Any, Any]:
        """What every trainer that samples reads before any model loads: ``(latent geometry, EmbeddingDataset checked
        against the model's text encoders and the reward's prompt grammar, RolloutConfig)``; also opens and checks
        --eval_prompts (a prompt file is encoded first, with the training data's text length)."""
        args = self.args
        fill_family_sampling(args)  # validation did it; a caller that skips validation gets the same values
        family = models.family_for(args)
        guided = args.cfg_scale > 1
        dataset = EmbeddingDataset(args.data_json_path).use(family, negative=guided)
        geometry = models.geometry_for(family, args.pretrained_model_name_or_path, args.h, args.w, args.num_frames,
                                       condition=dataset.condition_size)
        dataset.check_encoders(args.pretrained_model_name_or_path, models.spec_of(args))
        check_reward_prompts(args.reward, dataset.prompts, f"--data_json_path {args.data_json_path}",
                             judge_score=args.judge_score)
        sp = args.sp_size
        if sp > 1 and dataset.max_sequence_length % sp:  # the evaluation prompts share this length (below)
            raise ValueError(parallel.text_length_refusal(dataset.max_sequence_length, sp))
        if args.eval_prompts is not None:
            eval_reward = args.eval_reward
            if eval_reward:  # its files, before the evaluation prompts are encoded
                check_reward_paths(eval_reward, **{k: getattr(args, k) for k in REWARD_PATH_FLAGS})

            # a prompt file is encoded once, with the training data's length and dtype; a manifest is used as it is
            manifest = prompt_manifest(args.eval_prompts, args.pretrained_model_name_or_path,
                                       self.out / "eval_embeddings", max_sequence_length=dataset.max_sequence_length,
                                       dtype=dataset.manifest["dtype"], device=self.device,
                                       model_family=models.spec_of(args),
                                       negative_prompt=dataset.negative_prompt if guided else None)
            self.eval_dataset = EmbeddingDataset(manifest).use(family, negative=guided)
            self.eval_dataset.check_encoders(args.pretrained_model_name_or_path, models.spec_of(args))
            for spec in filter(None, (args.reward, eval_reward)):
                check_reward_prompts(spec, self.eval_dataset.prompts, f"--eval_prompts {args.eval_prompts}",
                                     judge_score=args.judge_score)
            if self.eval_dataset.condition_size != dataset.condition_size:
                raise ValueError(f"--eval_prompts holds sources of {self.eval_dataset.condition_size} but "
                                 f"--data_json_path of {dataset.condition_size} (height, width): preprocess the "
                                 "evaluation edits with the training store's --edit_size")
            if self.eval_dataset.max_sequence_length != dataset.max_sequence_length:
                raise ValueError(f"--eval_prompts has {self.eval_dataset.max_sequence_length} text tokens but "
                                 f"--data_json_path has {dataset.max_sequence_length}: preprocess the evaluation "
                                 f"prompts with --max_sequence_length {dataset.max_sequence_length}, or pass the "
                                 "prompt file itself (it is then encoded with the training data's length)")
        self.geometry, self.rollout_cfg, self.dataset = geometry, RolloutConfig.from_args(args), dataset
        return geometry, dataset, self.rollout_cfg

    @staticmethod
    def sources_of(dataset: Any, prompt_ids: Any) -> torch.Tensor | None:
        """An edit store's source images of ``prompt_ids`` (``EmbeddingDataset.source_images``); None for a prompt
        store or none."""
        return None if dataset is None else dataset.source_images(prompt_ids)

    def prompt_groups(self) -> tuple[Any, Any, Any, Any]:
        """The inputs of a trainer that samples --num_generations images for each of --prompts_per_step prompts per
        step (GRPO, NFT, online DPO), checked before any model loads: the reward spec, then ``sampling_inputs``;
        returns ``(latent geometry, EmbeddingDataset, GroupSampler, RolloutConfig)``."""
        args = self.args
        parse_reward_spec(args.reward)
        geometry, dataset, cfg = self.sampling_inputs()
        sampler = GroupSampler(len(dataset), args.prompts_per_step, args.num_generations, seed=args.seed,
                               rank=self.dist.dp_rank, world_size=self.dist.dp_size)
        return geometry, dataset, sampler, cfg

    def load_models(self, *, reward: bool, need_reference: bool, ref_snapshot: bool = False,
                    old_policy: bool = False, optimizer_steps: int) -> None:
        """Write OUT/config.json (rank 0, after every input check passed), then load the reward (checks its checkpoint
        paths first; also loaded without ``reward`` when --eval_prompts is set; with --eval_prompts also the
        --eval_reward rewards; with --reward_overlap its scorer thread), policy (+ reference, EMA),
        optimizer, LR schedule (``optimizer_steps`` long) and VAE (in the compute dtype: bf16 on a GPU/NPU)."""
        args = self.args
        errors.inputs_checked()  # from here on an error is the run's (traceback), not a bad flag's (one line)
        if self.dist.is_main:
            save_config(self.config, self.out / "config.json")
        self.memory_baseline = current_memory_gb(self.device, import_model_libraries=True)
        paths = {k: getattr(args, k) for k in REWARD_PATH_FLAGS}
        if reward or self.eval_dataset is not None:
            self.reward_fn = build_reward(args.reward, self.device, batch_size=args.reward_batch_size, **paths)
            self.reward_fn.nonfinite = "keep"  # gather_rewards handles a NaN per --nonfinite_reward, on every rank
        if reward and args.reward_overlap:
            self.scorer = OverlapScorer(self.reward_fn, self.device)
        if self.eval_dataset is not None and args.eval_reward:  # built once, beside --reward's
            self.eval_reward_fn = build_reward(args.eval_reward, self.device, batch_size=args.reward_batch_size,
                                               **paths)
        self.policy = build_policy(args, self.device, need_reference=need_reference, ref_snapshot=ref_snapshot,
                                   old_policy=old_policy)
        self.sync_every_backward = parallel.resolve_gradient_sync(args.gradient_sync, self.policy.is_lora) == "backward"
        self.optimizer = build_optimizer(self.policy, args)  # right after sharding (FSDP2 swaps in DTensors)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, args, optimizer_steps)
        self.vae = models.family_for(args).load_vae(args.pretrained_model_name_or_path,
                                                    dtype=self.amp_dtype or torch.float32,
                                                    device=self.device)  # decodes in the compute dtype, as FluxPipeline
        self.flop_meter = flops.FlopMeter(self.dist.sp_size)  # model FLOPs per phase, for tflops_* and mfu
        old = self.policy.old.old_model if self.policy.old is not None else None
        for model in (self.policy.model, self.policy.frozen_ref, old):
            if model is not None:
                self.flop_meter.attach(model)
        D.barrier()  # every rank measures at once (ranks sharing a host share its cores)
        self.peak_flops, source = flops.resolve_peak(args.peak_tflops, self.device, self.amp_dtype or torch.float32)
        if self.dist.is_main:
            print(f"mfu: against {self.peak_flops / 1e12:.4g} TFLOP/s per device ({source})", flush=True)

    def resume(self, **state: Any) -> int:
        """Restore the checkpoint (if resuming) into the models and ``state`` (name -> object with
        ``state_dict``/``load_state_dict``, e.g. ``sampler=``), open the metrics logger and progress bar; returns the
        last step done (0 for a fresh run)."""
        args, rank = self.args, self.dist.rank
        self.state = state
        if self.resume_dir is not None:
            extra = load_state(self.resume_dir, self.policy, self.optimizer, self.lr_scheduler)
            self.start_step, self.skipped_updates = extra["step"], extra["skipped_updates"]
            self.train_seconds = extra.get("train_seconds", 0.0)
            self.consecutive_skips = extra.get("consecutive_skips", 0)
            self.dropped_samples = extra.get("dropped_samples", 0)
            for name, obj in self.state.items():
                obj.load_state_dict(extra[name])
            set_rng_state(extra["rng"][rank] if rank < len(extra["rng"]) else extra["rng"][0])
            if self.dist.is_main:
                print(f"resumed from {self.resume_dir} at step {self.start_step}", flush=True)
        self.logger = MetricsLogger(self.out, enabled=self.dist.is_main, sinks=args.log_to, config=self.config,
                                    wandb_project=args.wandb_project, wandb_mode=args.wandb_mode,
                                    resume_step=self.start_step if self.resume_dir else None)
        self.bar = progress_bar(args.max_train_steps, self.start_step, enabled=self.dist.is_main and args.progress_bar)
        if self.eval_dataset is not None and self.start_step == 0:
            self.logger.log(0, self.evaluate(0))
        self.step_started = time.perf_counter()
        return self.start_step

    def evaluate(self, step: int) -> dict[str, float]:
        """Sample the first --eval_max_prompts prompts of --eval_prompts --eval_num_images times each with the current
        weights (``evaluation.ode_images``: Euler ODE, the run's steps/shift/guidance, initial noise keyed by (seed,
        "eval", prompt id, image index): the same at every evaluation), score them with --reward and return
        ``evaluation.eval_metrics`` (``eval/reward_mean``, its std and 95% interval, ``eval/reward_<component>``), with
        --eval_reward its rewards' ``evaluation.extra_eval_metrics`` (``eval/<name>``, ``eval/<name>_<key>``), and
        ``time_eval`` (seconds); rank 0 saves OUT/samples/eval-step-N.png (up to 16 images: the first of each rank's
        slice) and mirrors it to TensorBoard / W&B. Images are split over ranks (padded to equal counts: FSDP needs the
        same forwards on every rank). A collective; draws no global randomness."""
        args, ds, dist = self.args, self.eval_dataset, self.dist
        t0 = time.perf_counter()
        n = min(args.eval_max_prompts or len(ds), len(ds))
        total = n * args.eval_num_images
        prompt_ids, sample_indices, real = evaluation.image_items(n, args.eval_num_images, dist.dp_rank,
                                                                  dist.dp_size)
        noise = NoiseSource(derive_seed(args.seed, "eval"), device=args.noise_device)
        with flops.phase(None):  # not training work: outside the step's tflops / mfu
            images = evaluation.ode_images(self.policy.model, self.vae, ds, prompt_ids, sample_indices,
                                           self.rollout_cfg, noise, self.geometry, device=self.device,
                                           amp_dtype=self.amp_dtype)
        prompts = [ds.prompts[i] for i in prompt_ids]
        sources = self.sources_of(ds, prompt_ids)
        rewards, _ = self.score(images, prompts, sources=sources)  # gathered: entries >= total are padding
        all_ids = torch.arange(total) // args.eval_num_images  # the global order of evaluation.image_items
        summary = evaluation.reward_summary({k: v[:total] for k, v in rewards.items()}, all_ids)
        metrics = evaluation.eval_metrics(summary)
        if self.eval_reward_fn is not None:  # --eval_reward: eval/<name>, eval/<name>_<key>, beside eval/reward_*
            extra, _ = self.score(images, prompts, self.eval_reward_fn, sources=sources)
            extra = evaluation.extra_scores({k: v[:total] for k, v in extra.items()}, rewards)
            metrics.update(evaluation.extra_eval_metrics(evaluation.reward_summary(extra, all_ids)))
        shown = D.gather_samples(images[:min(real, -(-16 // dist.dp_size))].cpu())  # (<= 16 + dp, 3, H, W)
        if dist.is_main:
            grid = save_image_grid(shown[:16], self.out / "samples" / f"eval-step-{step:06d}.png")
            self.logger.log_image("eval/samples", grid, step)
            if shown.ndim == 5:  # videos: the strips above, and the videos themselves to TensorBoard / W&B
                self.logger.log_video("eval/videos", shown[:16], step, args.fps or 16)
        metrics["time_eval"] = time.perf_counter() - t0
        return metrics

    def pending_rewards(self, prompts: list[str], prompt_ids: Any = None) -> PendingRewards | None:
        """With --reward_overlap, the scoring of the coming rollout (``prompts``: this rank's, in sample order; their
        ``prompt_ids`` give an edit run's sources): pass it as ``rollout(..., on_decoded=...)`` and then to
        ``score_rollout``; None without it, or with --replay_images (the recorded images replace the rollout's after
        it), for the sequential path."""
        if self.scorer is None or (self.replay is not None and self.replay.use_images):
            return None
        share, mine = self._reward_share(len(prompts))
        sources = None if prompt_ids is None else self.sources_of(self.dataset, prompt_ids)
        return PendingRewards(self.scorer, list(prompts), share, mine, sources)

    def score_rollout(self, traj: Any, prompts: list[str], pending: PendingRewards | None = None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """``score`` this rank's rollout (a ``rollout.Trajectory`` of the current step), or with ``pending``
        (``pending_rewards``, fed by the rollout) join the scores computed while it sampled and gather them the same
        way. With --replay_images the recorded images are scored instead of the decoded ones; with --record_dir the
        images, each sample's rewards (this rank's slice) and the old log-probs are recorded. Returns the gathered
        rewards and the step's ``time_reward`` (seconds the step waited for them after the rollout) and
        ``time_reward_busy`` (seconds the reward computed: equal without --reward_overlap)."""
        prompt_ids, sample_indices = traj.prompt_ids.tolist(), traj.sample_indices.tolist()
        images = traj.images
        if pending is None:
            if self.replay is not None and self.replay.use_images:
                images = self.replay.images(traj.step, prompt_ids, sample_indices, like=images)
            rewards, seconds = self.score(images, prompts, sources=self.sources_of(self.dataset, prompt_ids))
            times = {"time_reward": seconds, "time_reward_busy": seconds}
        else:
            t0 = time.perf_counter()
            try:
                (local, busy), error = pending.scorer.join(), None
            except Exception as err:  # noqa: BLE001  (every rank raises it in gather_rewards)
                local, busy, error = None, 0.0, err
            times = {"time_reward": time.perf_counter() - t0, "time_reward_busy": busy}
            rewards = self.gather_rewards(local, error, pending.prompts[pending.share], pending.mine)
        if self.recorder is not None:
            log_probs = traj.log_probs if bool(traj.stochastic.any()) else None
            self.recorder.add_samples(traj.step, prompt_ids, sample_indices, prompts, images,
                                      {k: self.local(v) for k, v in rewards.items()}, log_probs)
        return rewards, times

    def score(self, images: torch.Tensor, prompts: list[str], reward_fn: Callable | None = None,
              sources: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], float]:
        """Reward this rank's images in one batched call of ``reward_fn`` (default: --reward's), all-gathered over
        ranks (``gather_rewards``): ``name -> (P*G,)`` CPU float32 in global sample order (every component and
        "total"; a prompt group may span ranks), and the seconds the call took. ``sources``: an edit run's source
        images of these samples (``sources_of``), which the reward compares them with.
        Under --sp_size the ranks of a sequence-parallel group hold the same images: each scores its consecutive share,
        so every image is scored once and the gather is in sample order."""
        share, mine = self._reward_share(len(prompts))
        if self.dist.sp_size > 1:
            images, prompts = images[share], prompts[share]
            sources = None if sources is None else sources[share]
        t0 = time.perf_counter()
        try:
            fn = reward_fn or self.reward_fn
            local, error = (fn(images, prompts) if sources is None else fn(images, prompts, sources=sources)), None
        except Exception as err:  # noqa: BLE001  (every rank raises it in gather_rewards)
            local, error = None, err
        seconds = time.perf_counter() - t0
        return self.gather_rewards(local, error, prompts, mine), seconds

    def _reward_share(self, n: int) -> tuple[slice, int]:
        """Which of this rank's ``n`` samples it scores (its sequence-parallel group's share: consecutive) and how many
        of those scores it sends; a rank whose share is empty scores one image and sends none (for the reward's
        keys)."""
        if self.dist.sp_size == 1:
            return slice(0, n), n
        share = torch.arange(n).tensor_split(self.dist.sp_size)[self.dist.sp_rank]
        return (slice(int(share[0]), int(share[-1]) + 1), len(share)) if len(share) else (slice(0, 1), 0)

    def gather_rewards(self, local: dict[str, torch.Tensor] | None, error: BaseException | None,
                       prompts: list[str], mine: int) -> dict[str, torch.Tensor]:
        """The ranks' scores of their samples (``local``: name -> (b,), the first ``mine`` sent; ``prompts`` theirs)
        all-gathered in sample order, non-finite ones handled per --nonfinite_reward. A collective that first agrees
        on failure: if the reward raised on any rank (``error``), every rank raises the same ``RewardFailed``
        instead of leaving the others waiting in the gather."""
        self._agree_on_reward_failure(error)
        stacked = torch.stack([v.float().cpu() for v in local.values()], dim=1)[:mine]  # (b, components + total)
        prompts = prompts[:mine]
        gathered = D.all_gather_tensor(stacked)
        bad = ~torch.isfinite(gathered).all(dim=1)  # the same on every rank
        if bad.any():
            gathered = self._nonfinite_rewards(gathered, bad, list(local), prompts)
        return dict(zip(local, gathered.unbind(dim=1)))

    def _agree_on_reward_failure(self, error: BaseException | None) -> None:
        """Every rank's reward outcome (one object gather); if any failed, ``RewardFailed`` on every rank, naming the
        first failing rank, its error and the checkpoint to continue from."""
        failed = [(rank, text) for rank, text in enumerate(
            D.all_gather_object(None if error is None else f"{type(error).__name__}: {error}"[:2000])) if text]
        if not failed:
            return
        rank, text = failed[0]
        also = f" (and on rank(s) {', '.join(str(r) for r, _ in failed[1:])})" if len(failed) > 1 else ""
        latest = ckpt.latest_checkpoint(self.args.output_dir)
        where = (f"; checkpoint {latest} is intact: fix the reward, then continue with --resume_from latest"
                 if latest is not None else "")
        raise RewardFailed(f"the reward failed on rank {rank}{also}: {text}{where}") from error

    def _nonfinite_rewards(self, gathered: torch.Tensor, bad: torch.Tensor, names: list[str], prompts: list[str]
                           ) -> torch.Tensor:
        """--nonfinite_reward error: raise (on every rank alike) naming the reward and the prompt; drop: set every
        component of those samples to NaN (advantages, pairs and metrics then leave them out) and count them."""
        all_prompts = [p for per_rank in D.all_gather_object(list(prompts)) for p in per_rank]
        first = int(bad.nonzero()[0])
        culprits = [n for n, v in zip(names, gathered[first].tolist()) if not math.isfinite(v)]
        name = next((n for n in culprits if n != "total"), culprits[0])
        value = gathered[first, names.index(name)].item()
        if self.args.nonfinite_reward == "error":
            raise ValueError(f"reward {name!r} returned {value} for prompt {all_prompts[first]!r} ({int(bad.sum())} of "
                             f"{len(bad)} samples non-finite); fix the reward (its checkpoint, input range or dtype) "
                             "or pass --nonfinite_reward drop to drop such samples and go on")
        self.dropped_samples += int(bad.sum())
        if self.dist.is_main:
            print(f"warning: dropped {int(bad.sum())} sample(s) with a non-finite reward (e.g. {name!r} = {value} for "
                  f"prompt {all_prompts[first]!r}); {self.dropped_samples} so far", flush=True)
        gathered = gathered.clone()
        gathered[bad] = float("nan")
        return gathered

    def local(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's equal slice of a gathered per-sample tensor (e.g. rewards in global sample order): its
        data-parallel replica's (the same on every rank of a sequence-parallel group)."""
        n = len(values) // self.dist.dp_size
        return values[self.dist.dp_rank * n:(self.dist.dp_rank + 1) * n]

    def advantages(self, rewards: torch.Tensor, samples: Any, prompt_ids: torch.Tensor
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """Group advantages (docs/algorithms.md §3) of the step's gathered ``rewards`` (P*G,) with
        --global_std/--adv_clip_max/--adv_eps/--group_std: ``(all advantages (P*G,), their metrics, this rank's slice
        on the device)``. ``prompt_ids``: this rank's samples' prompt ids (checked against the sampler's group order
        after gathering)."""
        args = self.args
        group_ids = torch.arange(args.prompts_per_step).repeat_interleave(args.num_generations)  # (P*G,)
        expected = torch.tensor(samples.group_prompt_ids).repeat_interleave(args.num_generations)
        assert torch.equal(D.gather_samples(prompt_ids.cpu()), expected), "gathered samples are not in group order"
        adv_all, metrics = group_advantages(rewards, group_ids, global_std=args.global_std,
                                            adv_clip_max=args.adv_clip_max, eps=args.adv_eps,
                                            group_std=args.group_std)
        n = len(prompt_ids)
        return adv_all, metrics, adv_all[self.dist.dp_rank * n:(self.dist.dp_rank + 1) * n].to(self.device)

    def set_gradient_sync(self, last_backward: bool) -> None:
        """Before each backward: reduce-scatter now (--gradient_sync backward) or only on a cycle's last backward."""
        parallel.set_gradient_sync(self.policy.model, self.sync_every_backward or last_backward)

    def throughput(self, metrics: dict[str, Any]) -> dict[str, float]:
        """``tflops_rollout``, ``tflops_train`` and ``mfu`` of the step (``flops.throughput_metrics`` from the FLOPs
        the meter counted since the last step and the trainer's time_rollout / time_train / time_step), the mean over
        ranks (a collective)."""
        seconds = {name: float(metrics.get(f"time_{name}", 0.0)) for name in ("rollout", "train", "step")}
        local = flops.throughput_metrics(self.flop_meter.take(), seconds, self.peak_flops)
        keys = ("tflops_rollout", "tflops_train", "mfu")
        present = torch.tensor([k in local for k in keys], dtype=torch.float32)
        values = torch.tensor([local.get(k, 0.0) for k in keys], dtype=torch.float32)
        summed = D.all_reduce_sum(torch.cat([values, present]))
        return {k: float(summed[i] / summed[3 + i]) for i, k in enumerate(keys) if summed[3 + i] > 0}

    def backward(self, loss: torch.Tensor, last_backward: bool) -> None:
        """``set_gradient_sync(last_backward)``, then back-propagate ``loss``, times --sp_size: each rank of a
        sequence-parallel group gets only its own tokens' share of the parameter gradients (they sum to the whole)
        and FSDP averages over all dp x sp ranks, so the factor makes the result the mean over data-parallel
        replicas, as without sequence parallelism."""
        self.set_gradient_sync(last_backward)
        (loss * self.dist.sp_size if self.dist.sp_size > 1 else loss).backward()

    def optimizer_step(self) -> float:
        """Clip the gradient norm, step optimizer + schedule + EMA (skipped, and counted, when the norm is not
        finite: a NaN/inf loss or gradient; ``end_step`` stops the run after more than --max_consecutive_skips in a
        row), zero the gradients; returns the norm before clipping."""
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm > 0 else math.inf
        grad_norm = parallel.clip_grad_norm(self.policy.model, max_norm)
        self.step_grad_norms.append(grad_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.lr_scheduler.step()
            if self.policy.ema is not None:
                self.policy.ema.update()
            self.consecutive_skips = 0
        else:
            self.skipped_updates += 1
            self.consecutive_skips += 1
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def end_step(self, step: int, metrics: dict[str, Any], images: torch.Tensor | None,
                 postfix: dict[str, str], trace: dict[str, torch.Tensor] | None = None) -> bool:
        """Log ``metrics`` (+ lr, skipped updates, peak and baseline memory over ranks, training seconds so far;
        + ``evaluate`` every --eval_every steps and at the last step), advance the bar, save rank 0's sample grid
        every --sample_every steps (and at step 1), checkpoint every --checkpointing_steps (and at the last step).
        Returns True when this was the last step: --max_train_steps, past --max_train_seconds, or a stop signal
        (SIGTERM/SIGINT on any rank: checkpoint now, no evaluation; ``finish`` then skips the export). Raises after
        writing the checkpoint when more than --max_consecutive_skips updates in a row were skipped. A collective:
        every rank calls it, and every rank takes the same decisions (one gather of the ranks' clocks and signals).
        With --replay_dir it first checks that the ranks used every recorded draw of the step; with --record_dir it
        writes the step's recording (``trace``: this rank's per-update tensors, e.g. ``loss`` (micro-batches,
        trained timesteps), and the step's grad norms).
        """
        args = self.args
        now = time.perf_counter()
        self.train_seconds += now - self.step_started
        metrics = {**metrics, **self.throughput(metrics)}
        if self.replay is not None:
            self.replay.check_step(step)
        seconds, signals = zip(*D.all_gather_object((self.train_seconds, preemption.requested())))
        over_time = bool(args.max_train_seconds) and max(seconds) >= args.max_train_seconds
        stop_signal = next((sig for sig in signals if sig), None)
        preempted = stop_signal is not None and step < args.max_train_steps
        too_many_skips = bool(args.max_consecutive_skips) and self.consecutive_skips > args.max_consecutive_skips
        last = step == args.max_train_steps or over_time or preempted
        eval_seconds = 0.0
        if self.eval_dataset is not None and not preempted and (
                last or (args.eval_every and step % args.eval_every == 0)):
            metrics = {**metrics, **self.evaluate(step)}
            eval_seconds = metrics["time_eval"]
        metrics = {**metrics, "lr": self.lr_scheduler.get_last_lr()[0], "skipped_updates": self.skipped_updates,
                   "peak_memory_gb": D.all_reduce_max(peak_memory_gb(self.device)),
                   "memory_baseline_gb": D.all_reduce_max(self.memory_baseline), "time_elapsed": self.train_seconds}
        if args.nonfinite_reward == "drop":
            metrics["dropped_samples"] = self.dropped_samples
        self.logger.log(step, metrics)
        if self.recorder is not None:
            self.recorder.end_step(step, metrics, trace, self.step_grad_norms)
        self.step_grad_norms = []
        self.bar.update(1)
        self.bar.set_postfix(**display_values(metrics),
                             **{k: fmt.format(float(metrics[k])) for k, fmt in postfix.items()})
        if (images is not None and args.sample_every and (step % args.sample_every == 0 or step == 1)
                and self.dist.is_main):
            grid = save_image_grid(images, self.out / "samples" / f"step-{step:06d}.png")
            self.logger.log_image("samples", grid, step)
            if images.ndim == 5:
                self.logger.log_video("videos", images, step, args.fps or 16)
        if step % args.checkpointing_steps == 0 or last or too_many_skips:
            save_state(args, step, self.policy, self.optimizer, self.lr_scheduler, extra={
                "step": step, "skipped_updates": self.skipped_updates, "rng": D.all_gather_object(rng_state()),
                "config": self.config, "train_seconds": self.train_seconds,
                "consecutive_skips": self.consecutive_skips, "dropped_samples": self.dropped_samples,
                **{name: obj.state_dict() for name, obj in self.state.items()}},
                manifest=run_identity(self.config), resumed_from=self.resume_dir)
        if too_many_skips:
            raise RuntimeError(
                f"{self.consecutive_skips} updates in a row were skipped for a non-finite loss or gradient (more than "
                f"--max_consecutive_skips {args.max_consecutive_skips}) at step {step}; checkpoint "
                f"{ckpt.checkpoint_path(args.output_dir, step)} holds the last good weights. Lower --learning_rate, "
                "check the reward and the inputs (skipped_updates in metrics.jsonl), then --resume_from latest")
        if preempted:
            self.preempted = (step, stop_signal)
        elif over_time and step < args.max_train_steps and self.dist.is_main:
            print(f"stopping after step {step}: {self.train_seconds:.0f} s of training reached --max_train_seconds "
                  f"{args.max_train_seconds:g}", flush=True)
        end = time.perf_counter()
        self.train_seconds += end - now - eval_seconds
        self.step_started = end
        return last

    def finish(self) -> Path:
        """Close the logger and bar, export OUT/final (a collective), print where everything is; after a stop signal
        only say where the checkpoint is and how to continue (no export: the run is not done). Returns the export
        folder, or the checkpoint after a stop signal."""
        self.bar.close()
        self.logger.close()
        if self.scorer is not None:
            self.scorer.close()
        if self.preempted is not None:
            step, signal_name = self.preempted
            path = ckpt.checkpoint_path(self.args.output_dir, step)
            if self.dist.is_main:
                print(f"{signal_name}: stopped after step {step} of {self.args.max_train_steps}; checkpoint {path}; "
                      "continue with --resume_from latest (the launchers pass it)", flush=True)
            return path
        final = export_final(self.args, self.policy)
        if self.dist.is_main:
            out = self.out
            plots = write_plots(out)
            print(f"metrics: {out / 'metrics.jsonl'}\nplots:   {plots}\nsamples: {out / 'samples'}\n"
                  f"checkpoints: {out / 'checkpoints'}\nexport:  {final}", flush=True)
        return final


def write_plots(out: Path) -> Path | str:
    """OUT/plots.png: the run's curves (``fastvideo.plot``), written at the end of a run; a plot that cannot be drawn
    is reported, never fatal (the run's outputs are already written)."""
    try:
        return plot_runs([out], out / "plots.png")
    except (ValueError, OSError) as err:
        return f"not written ({err})"


def start_run(args: argparse.Namespace, validate: Callable[[argparse.Namespace, int], dict[str, int]],
              plan: Callable[..., Any] | None = None) -> Run:
    """The checks before anything expensive, on every rank: the flags (``validate`` -> batch arithmetic, printed by
    rank 0; then the device-dependent defaults, ``resolve_device_defaults``), memory flags, a writable --output_dir
    (where interrupted saves are cleaned up), the resume checkpoint (complete, undamaged, same algorithm and config
    fingerprint), the memory plan on a GPU/NPU (``check_memory_plan`` with the trainer's ``plan``, e.g.
    ``memory.plan_grpo``; None: no plan gate), --record_dir / --replay_dir (``record.open_alignment``); then seeds and
    the noise source (recording or replaying). The trainer checks its own inputs (data, reward spec) next, before
    ``Run.load_models``."""
    dist = D.set_sequence_parallel(args.sp_size)  # ValueError on every rank when it does not divide the ranks
    counts = with_sp_counts(validate(args, dist.dp_size), dist.sp_size)  # samples split over the dp replicas
    resolve_device_defaults(args, dist.device.type)
    check_memory_flags(args, dist.world_size, dist.device)
    config = run_config(args, counts)
    check_output_dir(args.output_dir)
    ckpt.clean_interrupted_saves(args.output_dir)  # what a killed save left (the complete checkpoints are intact)
    resume_dir = resolve_resume(args)
    start_step = 0
    if resume_dir is not None:
        start_step = check_resume_step(resume_dir, args.max_train_steps)
        check_resume_checkpoint(resume_dir, config)
    if plan is not None:
        check_memory_plan(args, counts, plan, dist.world_size, dist.device.type,
                          devices.total_memory_bytes(dist.device))
    amp_dtype = compute_dtype(args.mixed_precision, dist.device)
    noise, recorder, replay = record.open_alignment(args, config, dist, NoiseSource(args.seed, device=args.noise_device),
                                                    amp_dtype, start_step, run_identity(config)["config_fingerprint"])
    seed_all(args.seed)
    notes = take_default_notes()
    if dist.is_main:
        for line in notes:
            print(line, flush=True)
        print("batch arithmetic: " + ", ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
    return Run(args=args, dist=dist, counts=counts, config=config, resume_dir=resume_dir, noise=noise,
               amp_dtype=amp_dtype, recorder=recorder, replay=replay)


def batch_to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The tensors of an ``EmbeddingDataset.get_batch`` dict moved to ``device`` (other entries kept); the prompt ids
    stay on the CPU: they are bookkeeping read on the host (noise keys), which on the device would be a host sync."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) and k != "prompt_ids" else v for k, v in batch.items()}


def reward_metrics(rewards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``reward_<component>`` means of gathered rewards (the total is logged as reward_mean/reward_std); samples
    dropped for a non-finite reward (NaN) are left out."""
    return {f"reward_{k}": v.nanmean() for k, v in rewards.items() if k != "total"}


def rank_mean(values: torch.Tensor) -> torch.Tensor:
    """Mean of this rank's metric values (a tensor of them, e.g. from ``to_host``), averaged over ranks (every rank has
    the same count)."""
    local = values.detach().float().cpu().mean()
    return D.all_reduce_sum(local) / D.get_world_size()


def training_order(run: Run, num_samples: int, adv_all: torch.Tensor | None, step: int,
                   ) -> tuple[list[list[tuple[torch.Tensor, torch.Tensor | None]]], float]:
    """This rank's optimizer steps of the rollout (GRPO's, DiffusionNFT's and AWM's update), each a list of
    micro-batches ``(local sample indices (b,), loss weights (b,) or None)``, and the share of the step's samples
    trained.

    Default: its samples in prompt-group order, --train_batch_size at a time, --gradient_accumulation_steps micro-
    batches per optimizer step, weights None (each micro-batch's loss is its mean). --shuffle_micro_batches (a keyed
    permutation of the gathered batch) and --drop_zero_advantage (only samples with A != 0, Flow-GRPO) cut the
    step's global training order into optimizer steps with ``advantages.share_samples``: each rank trains its own
    samples of each, padded at weight 0 to the same count, real samples at weights that make the loss the mean over
    the optimizer step's samples, whatever the world size."""
    args, counts = run.args, run.counts
    tbs, accum = args.train_batch_size, counts["gradient_accumulation_steps"]
    drop = getattr(args, "drop_zero_advantage", False)  # GRPO's flag (train_nft.py has --shuffle_micro_batches only)
    if not (drop or args.shuffle_micro_batches):
        micro = [(idx, None) for idx in torch.arange(num_samples).split(tbs)]
        return [micro[c:c + accum] for c in range(0, len(micro), accum)], 1.0
    if adv_all is None:
        raise ValueError("--shuffle_micro_batches / --drop_zero_advantage order the gathered batch: pass adv_all")
    total = len(adv_all)
    selected = nonzero_selection(adv_all) if drop else torch.arange(total)
    order = shuffle_order(run.noise, step, total, selected=selected) if args.shuffle_micro_batches else selected
    rank = run.dist.dp_rank
    chunks = share_samples(order, rank, run.dist.dp_size, owners=torch.arange(total) // num_samples,
                           num_chunks=counts["optimizer_steps_per_rollout"])
    steps = [[(p - rank * num_samples, w) for p, w in zip(pos.split(tbs), weights.split(tbs)) if len(p)]
             for pos, weights in chunks]  # a chunk with no sample (every one dropped) is [] on every rank
    return steps, len(order) / total


def weighted_rank_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum(values * weights) / sum(weights)`` over every rank's entries (e.g. per-micro-batch metric means weighted
    by their real samples, when ranks pad their micro-batches); 0 when every weight is 0."""
    local = torch.stack([(values.detach().float().cpu() * weights).sum(), weights.sum()])
    total = D.all_reduce_sum(local)
    return total[0] / total[1].clamp(min=1e-12)


def to_host(tensors: dict[str, torch.Tensor | list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A step's metric tensors (each a tensor or a non-empty list of same-shaped tensors, stacked; all on one device) on
    the CPU in float32 through one device->host copy: one host sync at the end of the step instead of one per value."""
    stacked = {k: (v if torch.is_tensor(v) else torch.stack(v)).detach() for k, v in tensors.items()
               if torch.is_tensor(v) or v}  # an empty list is left out
    if not stacked:
        return {}
    sizes = [v.numel() for v in stacked.values()]
    flat = torch.cat([v.float().reshape(-1) for v in stacked.values()]).cpu()  # all on one device
    return {k: part.view(v.shape) for (k, v), part in zip(stacked.items(), flat.split(sizes))}
