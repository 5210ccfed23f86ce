"""One typed config for a run: the Prefect flow parameter, the CLI (presets + ``--set key=value``) and the
MLflow params are all this model. Validated at construction with messages that say how to fix things."""

from __future__ import annotations

import copy
import re
import json
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.curriculum import Phase


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EnvConfig(_Strict):
    name: str = Field("babyai", description="Registered environment name (babyai, ...).")
    options: dict[str, Any] = Field(default_factory=dict, description="Constructor options of the env.")
    num_servers: int = Field(1, ge=1, description="Env server processes spawned for a phase.")
    url: str | None = Field(None, description="Use an already running env server instead of spawning one.")
    urls: list[str] | None = Field(
        None, description="Several running env servers (on other hosts too) instead of spawning: episodes are "
                          "spread over them by free capacity (each server's /health pool size). env.url is the "
                          "same with one URL; set one of the two.")
    runtime: Literal["auto", "process", "docker"] = Field(
        "auto", description="How spawned env servers run: docker (containers through the Docker SDK, images from "
                            "infra/docker/), process (local subprocesses), auto (containers when a Docker daemon "
                            "answers and has the image, else processes).")
    image: str | None = Field(None, description="Container image of the env server (runtime docker/auto); default "
                                                "scalinginter/env-{light,web,sciworld}:latest by env.")
    dialect: Literal["scalinginter", "agentgym"] = Field(
        "scalinginter", description="Protocol of the server at env.url: 'scalinginter' (ours) or 'agentgym' (an "
                                    "unmodified AgentGym agentenv-* server; needs env.url).")
    prompt: Literal["default", "agentgym"] = Field(
        "default", description="How an episode's conversation starts: 'default' (a system message with the env's "
                               "instruction, the first observation as the user's turn) or 'agentgym' (AgentGym's "
                               "start, for parity runs: the instruction and the Thought/Action reply format as a "
                               "user turn, an 'OK' assistant turn, then the first observation).")
    request_timeout_s: float = Field(60.0, gt=0, description="Timeout of one env HTTP call.")
    task_pool: int = Field(100_000, ge=1, description="Train tasks are drawn from data_idx in [0, task_pool).")

    @field_validator("urls", mode="before")
    @classmethod
    def _split_urls(cls, v: Any) -> Any:
        """``[http://a:1,http://b:2]`` or ``http://a:1,http://b:2`` (how --set passes a list that is not JSON)."""
        if isinstance(v, str):
            v = [p.strip().strip("'\"") for p in v.strip().removeprefix("[").removesuffix("]").split(",")]
            v = [p for p in v if p]
        return v

    @model_validator(mode="after")
    def _dialect_needs_url(self):
        if self.url and self.urls:
            raise ValueError("env.url and env.urls are both set: give one server as env.url or all of them as "
                             "env.urls=[http://host1:port,http://host2:port]")
        if self.urls is not None and not self.urls:
            raise ValueError("env.urls is empty: list at least one env server URL, or drop it to spawn servers")
        if self.dialect == "agentgym" and not (self.url or self.urls):
            raise ValueError("env.dialect=agentgym talks to a running AgentGym server: set env.url=http://host:port")
        return self

    @property
    def server_urls(self) -> list[str] | None:
        """The running env servers this config names (env.urls, or env.url as one), None: spawn them."""
        return list(self.urls) if self.urls else ([self.url] if self.url else None)


class LoraConfig(_Strict):
    rank: int = Field(0, ge=0, description="LoRA: > 0 trains low-rank adapters of this rank (PEFT) on a frozen base "
                                           "model instead of every weight; the KL reference is the base with the "
                                           "adapters off (no second copy), vLLM serves the base and the adapter "
                                           "(only the adapter moves after an update), a checkpoint holds the adapter "
                                           "and its optimizer state. 0: off (full fine-tuning). Guide: guides/lora.")
    alpha: float | None = Field(None, gt=0, description="LoRA scaling numerator: the adapter's update is alpha / "
                                                        "rank x B A. None: 2 x rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input while training (the "
                                                        "learner's log-probs are taken with it off).")
    target_modules: list[str] | str = Field(
        "all-linear", description="The base's layers that get adapters: 'all-linear' (every linear layer of the "
                                  "decoder, not the output head) or module names, e.g. [q_proj,v_proj].")
    engine: Literal["auto", "adapter", "merged"] = Field(
        "auto", description="How a vLLM engine gets the policy: adapter (the base once, the adapter as a LoRA "
                            "request, only the adapter synced after an update), merged (the adapter merged into "
                            "the engine's weights, a full weight sync after every update; for builds or "
                            "architectures vLLM serves no LoRA for) or auto (adapter where the vLLM build and "
                            "the model's architecture take LoRA, else merged, said in the log; merged on vLLM's CPU "
                            "build, whose LoRA kernels generate several times slower than merged weights, and with "
                            "several engines, rollout.engines > 1, which all get full weights).")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _split_modules(cls, v: Any) -> Any:
        """``[q_proj,v_proj]`` or ``q_proj,v_proj`` (how --set passes a list that is not JSON) -> a list;
        ``all-linear`` stays a string."""
        if isinstance(v, str):
            s = v.strip()
            if s == "all-linear":
                return s
            v = [p.strip().strip("'\"") for p in s.removeprefix("[").removesuffix("]").split(",")]
            v = [p for p in v if p]
        if isinstance(v, list) and not v:
            raise ValueError("model.lora.target_modules is empty: give module names (e.g. [q_proj,v_proj]) or "
                             "all-linear")
        return v

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale_alpha(self) -> float:
        """alpha (2 x rank when unset)."""
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank


class ModelConfig(_Strict):
    path: str = Field("smollm2-135m", description="'smollm2-135m' (embedded GGUF) or an HF folder / hub id.")
    bf16_autocast: bool | None = Field(
        None, description="bf16 autocast over fp32 master weights (learner and transformers generation). None: on "
                          "where the hardware has native bf16 (AMX / AVX512-BF16 CPU, bf16 GPU), off elsewhere "
                          "(emulated bf16 on a CPU without native bf16 is far slower than fp32).")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: all cores).")
    device: str = Field("auto", description="Where the learner, critic, reference model and transformers "
                                            "generation run: auto (the CUDA GPU when torch sees one, else the CPU), "
                                            "cpu, cuda or cuda:N. vLLM picks its own device (its build: CUDA or CPU).")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters instead of full fine-tuning "
                                                                     "(model.lora.rank > 0).")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        s = str(v).strip().lower()
        if s in ("auto", "cpu", "cuda") or (s.startswith("cuda:") and s[5:].isdigit()):
            return s
        raise ValueError(f"model.device must be auto, cpu, cuda or cuda:N, got {v!r}")


class PhaseConfig(_Strict):
    turn_limit: int = Field(..., ge=1, description="Max agent turns per episode in this phase.")
    steps: int = Field(..., ge=1, description="Training steps in this phase.")


class GateConfig(_Strict):
    patience: int = Field(3, ge=1, description="End a phase after this many steps without improvement.")
    min_delta: float = Field(0.02, ge=0, description="Smallest rise of the smoothed success rate that counts.")
    threshold: float | None = Field(None, gt=0, le=1, description="End a phase once the smoothed success rate "
                                                                   "reaches this (None: only the plateau rule).")
    window: int = Field(3, ge=1, description="Steps in the moving average of the train success rate.")
    min_steps: int = Field(2, ge=1, description="A phase runs at least this many steps.")


class CurriculumConfig(_Strict):
    mode: Literal["steps", "gated"] = Field(
        "steps", description="'steps': phases of fixed length (ScalingInter); 'gated': a phase ends when its train "
                             "success rate stops improving or crosses a threshold (its steps are the maximum).")
    gate: GateConfig = Field(default_factory=GateConfig, description="Rules of the gated mode.")
    phases: list[PhaseConfig] = Field(
        default_factory=lambda: [PhaseConfig(turn_limit=6, steps=100), PhaseConfig(turn_limit=13, steps=100),
                                 PhaseConfig(turn_limit=20, steps=100)],
        description="Turn limit and length of each phase, in order.",
    )

    @model_validator(mode="after")
    def _nonempty(self):
        if not self.phases:
            raise ValueError("curriculum.phases is empty: give at least one {turn_limit, steps}")
        return self

    def as_phases(self) -> list[Phase]:
        return [Phase(p.turn_limit, p.steps) for p in self.phases]


class RolloutConfig(_Strict):
    backend: Literal["transformers", "vllm"] = Field(
        "vllm", description="Generation backend: vllm (one engine kept for the whole run and started once; weights "
                            "synced after each update; continuous batching, faster on batches of episodes) or transformers "
                            "(shares the learner's model; no start cost, for very short runs).")
    vllm_dtype: Literal["bfloat16", "float32", "float16", "auto"] | None = Field(
        None, description="vLLM weights dtype. None: bfloat16 where the hardware has native bf16, else float32.")
    vllm_enforce_eager: bool = Field(True, description="vLLM: skip graph compilation (a much faster engine start, "
                                                       "somewhat slower generation).")
    vllm_kv_cache_gb: float | None = Field(
        None, gt=0, description="vLLM CPU KV cache, a fixed size (GiB, fractions allowed; the bytes per token "
                                "follow from the model's layers, KV heads and dtype). None: sized from the batch (episodes x "
                                "token_budget x bytes per token) within vllm_kv_budget_gb.")
    vllm_kv_budget_gb: float = Field(
        1.0, gt=0, description="vLLM CPU: the most memory (GiB) the KV cache sized from the batch may take; when "
                               "the batch needs more, live episodes are capped to what fits (a warning says so). "
                               "The cache is resident whole once the engine starts (and after each update only as "
                               "far as rollouts fill it again: vllm_release_kv). On a few CPU cores more live "
                               "episodes do not generate faster (docs: concepts/rollout).")
    vllm_in_process: bool | None = Field(
        None, description="vLLM: run the engine core and its worker inside the trainer's process (no engine or "
                          "worker process: less memory, a faster engine start) instead of "
                          "child processes. Needs the torch learner (the worker sets up its own torch.distributed "
                          "group). None: in-process on the CPU build with the torch learner, else child processes.")
    vllm_release_kv: bool = Field(
        True, description="vLLM CPU build: the KV cache's memory goes back to the OS while the learner updates and "
                          "comes back zeroed after the weight sync, resident again page by page as rollouts fill it "
                          "(the CPU build has no sleep mode; the whole KV budget less resident during the update). "
                          "Ignored on GPUs (see vllm_sleep).")
    vllm_release_weights: bool = Field(
        True, description="vLLM CPU build, with vllm_release_kv: the packed weight copies the engine's linear layers "
                          "run on are dropped too while the learner updates (2 bytes per parameter in bf16); the "
                          "weight sync after the update rebuilds them, as every sync does.")
    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="vLLM on a GPU: the fraction of each GPU's memory the engine may take (weights, "
                                     "activations, KV cache); the learner uses the rest when they share the GPU. "
                                     "Ignored by the CPU build (see vllm_kv_cache_gb).")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM on GPUs: shard the engine over this many GPUs "
                                                           "(1 on the CPU build).")
    engines: int = Field(
        1, ge=1, description="vLLM: data-parallel rollout engines, each its own engine process with its own copy of "
                             "the weights and KV cache (each sized for its share of the batch) and tensor_parallel_size "
                             "GPUs. Every episode goes to the engine with the most free KV-cache room and stays there "
                             "for its later turns; after each update every engine loads the same weights "
                             "(engine_sync) and each engine's weight version is checked before a rollout uses it. "
                             "An engine that dies hands its turns in flight to the others. On the CPU build the "
                             "machine's cores are split between the engines. 1: the single engine.")
    engine_hosts: list[str] = Field(
        default_factory=list, description="Other machines for rollout engines, as HOST:GPUS (HOST alone: a CPU "
                                          "host). Engines fill the run's machine first (when it has GPUs or no host is "
                                          "named), then these in order; --dry-run shows the layout and refuses one "
                                          "that cannot be (e.g. more tensor-parallel GPUs than a host has). The run "
                                          "itself starts engines on its own machine only: it refuses a layout that "
                                          "needs these hosts.")
    engine_urls: list[str] = Field(
        default_factory=list, description="vLLM engines already serving on other hosts (http://HOST:PORT, each "
                                          "started there with `scalinginter engine-host`), joined to the run's "
                                          "engines: rollout.engines counts them, the rest start on the run's machine. "
                                          "Whatever engine_sync is, they reload the learner's weights from a "
                                          "folder written into engine_sync_dir after each update.")
    engine_sync_dir: str = Field(
        "", description="Where the learner writes the weight folder engines reload after an update (every engine "
                        "with engine_sync=folder; the engines at engine_urls always): with engine_urls, a folder each "
                        "engine host mounts at the same path, or an s3://bucket/prefix URI the hosts reach with their "
                        "own AWS settings (each load stored there, checked by sha256 on download, then deleted); "
                        "checked at the start: a host that cannot read it is refused. Empty: the system's temp folder "
                        "(engines on this machine only).")
    engine_sync: Literal["auto", "memory", "folder", "broadcast"] = Field(
        "auto", description="How engines get the learner's weights after each update when rollout.engines > 1: "
                            "memory (written once into shared memory on this machine; every engine loads from it), "
                            "folder (the learner writes an HF folder once; every engine reloads from it: the path for "
                            "engines that share a file system), broadcast (GPUs: an NCCL group of the learner and every "
                            "engine worker, the learner broadcasts each tensor: vLLM's RLHF weight-update route). "
                            "auto: memory.")
    engine_restarts: int = Field(
        2, ge=0, description="Times each rollout engine the run started is replaced when it dies. Several engines "
                             "(rollout.engines > 1): before the next weight sync or rollout round a new engine starts "
                             "in its place (the same cores or GPUs and settings) and gets the run's current weights; "
                             "meanwhile the engines left carry its turns. One engine in its own processes: a new one "
                             "starts at once, gets the learner's weights, and the rollout it broke runs again (a "
                             "training session's engine; an evaluation's fails the run as before). 0: a dead engine "
                             "stays dead. Engines on other hosts (engine_urls), in an NCCL broadcast group, or in the "
                             "trainer's own process (rollout.vllm_in_process) are not replaced.")
    vllm_sleep: bool | None = Field(
        None, description="vLLM sleep mode: the engine offloads its weights and drops its KV cache while the "
                          "learner updates (sleep level 1) and wakes before the weight sync and the next rollout, so "
                          "both fit one GPU. None: on when a CUDA engine shares the GPU with a learner in this "
                          "process; the CPU build has no sleep mode.")
    tasks_per_step: int = Field(4, ge=1, description="Distinct tasks per training step.")
    samples_per_task: int = Field(4, ge=1, description="Episodes per task (the GRPO group size).")
    max_new_tokens: int = Field(64, ge=1, description="Max tokens the policy may generate per turn.")
    token_budget: int = Field(2048, ge=16, description="Max tokens of a whole trajectory (prompt included).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    gen_batch_size: int = Field(32, ge=1, description="Max sequences per generate call.")
    kv_reuse_gib: float = Field(
        4.0, ge=0, description="transformers backend: memory (GiB) for the keys and values of the prompts it ran, "
                               "kept within a rollout so that a turn's prompt runs only its new tokens (the "
                               "observation, or what follows a shared instruction) through the model instead of "
                               "the whole conversation again; the least recently used are dropped beyond it, and "
                               "all of them when the weights change. The same rows are sampled together either "
                               "way; log-probs move by rounding, as they do with how a batch is padded. 0: off, "
                               "every prompt runs whole. (vLLM keeps its own prefix cache.)")
    env_retries: int = Field(1, ge=0, description="Times an episode masked by an env failure (server died, 5xx, "
                                                  "timeout) is run again, after dead env servers are replaced.")
    async_episodes: bool = Field(
        True, description="vLLM: every episode runs as its own loop on the engine's continuous batching (its next "
                          "turn is submitted as soon as its observation returns) instead of lock-step rounds that "
                          "wait for the slowest env step; same per-episode seeds and token caps. The transformers "
                          "backend always runs lock-step.")
    history_turns: int | None = Field(
        None, ge=0, description="History window: each turn's prompt holds the instruction, the last k turns (the "
                                "policy's replies as sampled and the env's observations) and the current "
                                "observation, so the prompt stops growing with the horizon; every turn is then its "
                                "own training sample (its prompt, its reply tokens, the turn's advantage) and "
                                "token_budget bounds each turn's prompt + reply. None: all turns (one growing "
                                "sequence per episode).")
    dynamic_sampling_rounds: int = Field(
        0, ge=0, description="Dynamic sampling: groups whose live samples all got the same reward (no group-relative "
                             "signal) are dropped and up to this many extra rollout rounds of fresh tasks refill the "
                             "step's tasks_per_step groups; the step trains on the groups with signal it has after "
                             "the last round (logged: groups kept and dropped, rounds used). 0: off.")
    task_filter: Literal["none", "fits_turns"] = Field(
        "none", description="How a step's training tasks are drawn: none (uniformly from env.task_pool) or "
                            "fits_turns (only tasks whose expert needs at most the phase's turn limit, read from "
                            "the env's info['required_turns'] at reset; for envs that label their tasks, BabyAI).")
    max_live_episodes: int | None = Field(
        None, ge=1, description="Episodes running at once (train and eval); the next start as others end. None: "
                                "all at once. Set it to what the env servers hold (browser contexts, JVMs) x "
                                "env.num_servers.")

    @model_validator(mode="after")
    def _budget(self):
        if self.token_budget <= self.max_new_tokens:
            raise ValueError(
                f"rollout.token_budget ({self.token_budget}) must exceed rollout.max_new_tokens "
                f"({self.max_new_tokens}): raise token_budget or lower max_new_tokens"
            )
        return self


class CriticConfig(_Strict):
    model: str | None = Field(None, description="PPO critic backbone: None = its own copy of the policy's initial "
                                                "model; or a smaller HF model / folder sharing the tokenizer.")
    lr: float | None = Field(None, gt=0, description="Critic learning rate (PPO only; default 1e-5).")
    value_clip: float = Field(0.2, gt=0, description="Clip range of the value loss around the old values.")


class AlgoConfig(_Strict):
    estimator: Literal["grpo", "ppo", "reinforce++", "rloo", "gigpo", "filtered-bc"] = Field(
        "grpo", description="Advantage estimator: grpo, ppo (GAE + critic), reinforce++, rloo, gigpo (GRPO's episode "
                            "advantage plus a step advantage among the group's turns from the same observation) or "
                            "filtered-bc (behaviour cloning on the step's own successful episodes: advantage 1 on "
                            "their policy tokens, 0 elsewhere; no negative gradient).")
    skip_no_signal: bool = Field(
        False, description="A step whose batch holds no nonzero advantage (and no expert-relabelled sample) changes "
                           "no weight and no optimizer state: the update and the weight sync are skipped and the step "
                           "is logged with train/skipped = 1 (otherwise AdamW's momentum moves every weight anyway).")
    truncated: Literal["fail", "mask"] = Field(
        "fail", description="Episodes a turn limit or token budget cut short: fail (scored as failures like any "
                            "other) or mask (left out of the policy-gradient loss: their advantage is 0; they still "
                            "count in their group's baseline).")
    expert_coef: float = Field(
        0.0, ge=0, description="Weight of an auxiliary log-likelihood term on the env expert's reply at states the "
                               "policy visited (DAgger-style relabels, see expert_turns), added to the policy loss as "
                               "expert_coef x the token-mean NLL of the relabelled replies. Needs an env with a "
                               "scripted expert (envs/<env>/contract.py: expert_action). 0: off.")
    invalid_action_penalty: float = Field(
        0.0, ge=0, description="Each turn whose reply the env flagged as no valid action gets -invalid_action_penalty "
                               "added to its reward (on that turn's action tokens), so among samples with the same "
                               "outcome the ones that spent turns on invalid replies score lower, and a group whose "
                               "samples all failed still ranks them. The episodes' own rewards and success stay as "
                               "the env gave them. 0: off.")
    shaping_coef: float = Field(
        0.0, ge=0, description="Potential-based progress reward: each turn's reward gets shaping_coef x (the turns the "
                               "env's expert needed before the turn - the turns it needs after it), so an episode "
                               "cut by the turn limit is credited with the progress it made, and the best policy is "
                               "unchanged (the shaping telescopes). Needs an env that reports the expert's remaining "
                               "turns (BabyAI: its label_remaining option, set by the run). 0: off.")
    expert_decay: Literal["none", "linear"] = Field(
        "none", description="How expert_coef changes over the run: none (constant) or linear (expert_coef x (1 - "
                            "global step / total steps)).")
    replay_solved: int = Field(
        0, ge=0, description="Up to this many groups of the step whose live samples all succeeded (no group-relative "
                             "signal: the estimator gives them 0, dynamic sampling drops them) stay in the batch with "
                             "advantage replay_coef on their own action tokens: tasks the policy already solves keep "
                             "a gradient (and the KL term sees their states) while it learns others. The groups "
                             "dynamic sampling dropped come first; when it dropped none, the batch's own solved groups "
                             "(solved in different numbers of turns, they kept some variance) are the ones. Needs a "
                             "group-relative estimator (grpo, rloo, gigpo). 0: off.")
    replay_coef: float = Field(1.0, gt=0, description="The advantage on a replayed solved group's action tokens "
                                                      "(algo.replay_solved).")
    expert_groups: bool = Field(
        False, description="A group in which every live sample failed gets the env expert's own episode of the task "
                           "(at the step's turn limit, when the expert succeeds within it) as one more member: the "
                           "group then has signal, the expert's replies a positive advantage. Those tokens were not "
                           "sampled, so their ratio is taken against the learner's own log-probs (1 at the first "
                           "optimizer step; clipped in later epochs). Needs the env's scripted expert.")
    expert_turns: int = Field(
        1, ge=1, description="Relabelled states per episode for the expert term: the first this many turns whose "
                             "reply differs from the expert's, earliest first (each is one extra learner sequence: "
                             "the episode up to that turn, then the expert's reply).")
    lr: float = Field(1e-6, ge=0, description="AdamW learning rate of the policy.")
    weight_decay: float = Field(0.0, ge=0)
    optimizer: Literal["adamw", "adamw8bit"] = Field(
        "adamw", description="The policy's optimizer: adamw (torch, fp32 moments: 8 bytes per parameter) or "
                             "adamw8bit (bitsandbytes' block-wise 8-bit AdamW: 2 bytes per parameter, a slower "
                             "optimizer step on the CPU; the torch learner only).")
    grad_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="How the policy's gradients are held between the backward and the optimizer step: fp32 "
                            "(4 bytes per parameter) or bf16 (2 bytes: each "
                            "backward's gradient goes into a bf16 buffer as soon as it is written, and the step takes "
                            "them back to fp32 one parameter at a time; a bf16-autocast matmul's weight gradient is a "
                            "bf16 value already, the sum over micro-batches rounds). The torch learner only.")
    kl_coef: float = Field(0.001, ge=0, description="KL to the frozen reference (0 = no reference): a k3 loss "
                                                    "term, or a reward penalty for reinforce++.")
    clip: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip.")
    grad_clip: float = Field(1.0, gt=0)
    normalize_std: bool = Field(True, description="GRPO: divide by the group's reward std.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount over policy tokens (ppo, reinforce++), or over turns "
                                                      "(gigpo; reinforce++ and grpo with algo.discount=turn).")
    discount: Literal["token", "turn"] = Field(
        "token", description="What algo.gamma discounts: each policy token (token), or each turn (turn: every token of "
                             "turn k sees sum_j gamma^(j-k) r_j; for reinforce++, and for grpo, which then scores turn "
                             "k by that return normalised among the group's turns k). gigpo always discounts per turn.")
    gigpo_step_weight: float = Field(1.0, ge=0, allow_inf_nan=False,
                                     description="gigpo: weight omega of the step (anchor-state) advantage: "
                                                 "A = A_episode + omega * A_step.")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (ppo).")
    whiten_advantages: bool = Field(True, description="PPO: normalise advantages over the batch's policy tokens.")
    loss_agg: Literal["token-mean", "seq-mean"] = Field(
        "token-mean", description="Loss aggregation: mean over all policy tokens, or mean of per-sequence means.")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="PPO critic (ignored otherwise).")
    skip_zero_advantage: bool = Field(
        True, description="Episodes whose advantage is 0 on every token (a group in which every sample scored the "
                          "same) skip the update's forward and backward when nothing else in the loss reads them (no "
                          "KL term in the loss, no critic, one rank): their gradient is exactly 0, and they still "
                          "count in the loss's denominator, so the update is the same. The update's entropy and "
                          "log-prob mismatch are then those of the episodes it ran (train/skipped_episodes says how "
                          "many did not). false: every episode runs.")
    micro_batch_size: int = Field(4, ge=1, description="Sequences per forward/backward pass.")
    micro_batch_tokens: int | None = Field(
        2048, ge=1, description="At most this many padded tokens (sequences x the longest) per forward/backward "
                                "pass, fewer sequences when they are long: bounds the learner's activation memory at "
                                "about the same time per token (docs: concepts/learner). None: micro_batch_size alone.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per epoch (the batch is split).")
    ppo_epochs: int = Field(1, ge=1, description="Passes over the batch per training step.")
    share_prefix: bool | None = Field(
        None, description="The samples of a group run their common prompt through the learner once per forward "
                          "(same log-probs and gradients, fewer FLOPs, more and smaller forwards). None: on on the "
                          "CPU, where FLOPs are the cost, and off on a GPU, where small forwards leave it idle (docs: "
                          "concepts/learner).")
    expert_branches: bool = Field(
        True, description="The expert term's relabels run as branches of their own episode's training forward: the "
                          "expert's reply tokens attend to the episode's keys and values up to the relabelled turn, "
                          "so the context is not run again (the same loss and gradients; where it cannot apply, a "
                          "relabel runs as its own sequence: docs: concepts/learner). false: every relabel runs as "
                          "its own sequence.")
    logprob_chunk: int = Field(512, ge=0, description="Policy positions whose log-probs (and entropies) are "
                                                      "computed at once: the [positions, vocab] logits never exceed "
                                                      "this many rows (recomputed per chunk in the backward pass). "
                                                      "0: all positions of a micro-batch at once (the old path).")
    length_buckets: int | None = Field(
        None, ge=0, description="The learner's forwards run on sequence lengths rounded up to the next of this many "
                                "evenly spaced lengths per doubling (8: ..., 64, 72, ..., 128, 144, ...: at most 1/8 "
                                "padding, on the right; a shared prompt is cut down to a bucket, its last tokens run "
                                "with each row): the same log-probs and gradients on few distinct matmul shapes. None: "
                                "8 on the CPU, where every new shape leaves compiled oneDNN kernels and a more "
                                "fragmented heap behind, and 0 (exact lengths) on a GPU, where padding equal-length "
                                "rows costs the maskless attention path (docs: concepts/learner).")
    activation_checkpointing: int = Field(
        0, ge=0, description="N > 0: every N-th decoder layer of the policy keeps only its input and recomputes its "
                             "activations in the backward pass (less update memory, ~1/3 more update FLOPs at N=1; "
                             "the shared-prompt forward is then off for the policy: transformers drops the cache in "
                             "checkpointed layers). 0: off.")
    activation_checkpointing_min_tokens: int = Field(
        0, ge=0, description="> 0: only micro-batches of at least this many padded tokens run checkpointed (every "
                             "activation_checkpointing-th layer, every layer when that is 0): the long episodes, whose "
                             "activations set the update's peak memory, pay the recompute; the short ones keep their "
                             "activations and their shared-prompt forward. 0: as activation_checkpointing says.")

    @model_validator(mode="after")
    def _estimator_options(self):
        if self.estimator != "ppo":
            if self.critic.lr is not None or self.critic.model is not None:
                raise ValueError(f"algo.critic is set but algo.estimator is {self.estimator!r}: only ppo trains a "
                                 "critic; set algo.estimator=ppo or drop the algo.critic settings")
            if self.lam != 1.0:
                raise ValueError(f"algo.lam is a GAE parameter and does nothing for {self.estimator!r}: set "
                                 "algo.estimator=ppo or leave algo.lam at 1.0")
        if self.discount == "turn" and self.estimator in ("ppo", "rloo", "filtered-bc"):
            raise ValueError(f"algo.discount=turn is not defined for {self.estimator!r}: use reinforce++, grpo or "
                             "gigpo, or leave algo.discount at token")
        if (self.estimator in ("rloo", "filtered-bc") or (self.estimator == "grpo" and self.discount == "token")) \
                and self.gamma != 1.0:
            raise ValueError(f"algo.gamma does nothing for {self.estimator!r} (a sequence-level outcome "
                             "estimator): use ppo, reinforce++ or gigpo (or grpo with algo.discount=turn), or leave "
                             "algo.gamma at 1.0")
        if self.expert_groups and self.estimator not in ("grpo", "rloo", "gigpo", "filtered-bc"):
            raise ValueError(f"algo.expert_groups completes groups of a group-relative estimator (grpo, rloo, gigpo) "
                             f"or filtered-bc's successes, not {self.estimator!r}: drop algo.expert_groups or change "
                             "algo.estimator")
        if self.expert_coef == 0 and (self.expert_decay != "none" or self.expert_turns != 1):
            raise ValueError("algo.expert_decay / algo.expert_turns shape the expert term, which is off "
                             "(algo.expert_coef=0): set algo.expert_coef > 0 or drop them")
        if self.estimator != "gigpo" and self.gigpo_step_weight != 1.0:
            raise ValueError(f"algo.gigpo_step_weight does nothing for {self.estimator!r}: set algo.estimator=gigpo "
                             "or leave it at 1.0")
        return self


class EvalConfig(_Strict):
    n: int = Field(16, ge=1, description="Held-out tasks scored (greedy) before and after training.")
    turn_limit: int | None = Field(None, ge=1, description="Eval turn limit (default: the last phase's).")
    max_new_tokens: int | None = Field(None, ge=1, description="Default: rollout.max_new_tokens.")
    before: bool = Field(True, description="Score the initial model before training.")
    after: bool = Field(True, description="Score the final model after training.")
    each_phase: bool = Field(False, description="Also score every phase's final checkpoint on the same held-out "
                                                "tasks (eval_phase-<k>.json; MLflow heldout/success_rate at the "
                                                "phase's last global step): a held-out learning curve.")
    each_phase_last: bool = Field(True, description="With each_phase: score the last phase's final in the run too "
                                                    "(false when the caller scores the final checkpoint itself, as "
                                                    "scalinginter study does; eval.after also covers it).")


class TrackingConfig(_Strict):
    uri: str | None = Field(None, description="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or local sqlite).")
    experiment: str = Field("scalinginter", description="MLflow experiment name.")
    log_trajectories: int = Field(4, ge=0, description="Sample trajectories logged as artifacts per step.")


class CheckpointConfig(_Strict):
    root: str | None = Field(None, description="Local dir or s3://bucket/prefix (default: <output_dir>/checkpoints).")
    every_n_steps: int = Field(1, ge=1, description="Step checkpoint interval within a phase.")
    keep_step_checkpoints: bool = Field(False, description="Keep superseded step checkpoints (default: a step "
                                        "checkpoint is deleted once a newer one or the phase's final is complete; "
                                        "phase finals are always kept).")
    s3_block: str | None = Field(None, description="Name of a Prefect 'scalinginter-s3-credentials' block with the S3 "
                                                 "endpoint/credentials (default: the standard AWS variables).")


class LearnerEngineConfig(_Strict):
    engine: Literal["torch", "deepspeed"] = Field("torch", description="Learner engine: plain torch or DeepSpeed ZeRO.")
    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage (configs in infra/deepspeed/).")
    ranks: int = Field(1, ge=1, description="DeepSpeed data-parallel ranks (>1: launched with torchrun).")
    offload_optimizer: bool = Field(False, description="DeepSpeed: CPU Adam with the optimizer state offloaded.")
    config_path: str | None = Field(None, description="DeepSpeed JSON config (default: infra/deepspeed/zero<stage>.json).")
    nodes: int = Field(1, ge=1, description="DeepSpeed across machines: nodes of learner.ranks ranks each, joined by "
                                            "torchrun's c10d rendezvous at master_addr:master_port (the run's machine "
                                            "is node 0; the others run `python -m runtime.backends.deepspeed_learner "
                                            "join`, see README 'Beyond one machine').")
    node_rank: int = Field(0, ge=0, description="This machine's node (0: the run's; the join command of the other "
                                                "nodes takes theirs).")
    master_addr: str | None = Field(None, description="Address of node 0 the other nodes reach (rendezvous and the "
                                                      "run's control connection). Needed when nodes > 1.")
    master_port: int = Field(29500, ge=1, le=65534, description="Rendezvous port on master_addr; the run's control "
                                                                "connection listens on master_port + 1.")

    @model_validator(mode="after")
    def _nodes(self):
        if self.nodes > 1:
            if self.engine != "deepspeed":
                raise ValueError("learner.nodes > 1 needs learner.engine=deepspeed")
            if not self.master_addr:
                raise ValueError("learner.nodes > 1: set learner.master_addr to node 0's address the other nodes "
                                 "reach (and learner.master_port, default 29500)")
        if self.node_rank >= self.nodes:
            raise ValueError(f"learner.node_rank ({self.node_rank}) must be below learner.nodes ({self.nodes})")
        return self


class ResumeConfig(_Strict):
    allow_changes: list[str] = Field(
        default_factory=list,
        description="Training settings (dotted keys, e.g. algo.lr or env.options) a resumed run may change from "
                    "its checkpoints' config; any other difference refuses the resume. On the command line: "
                    "--set 'resume.allow_changes=[algo.lr,env.options]'.")

    @field_validator("allow_changes", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        """``[a.b,c]`` or ``a.b,c`` (how --set passes a list that is not JSON) -> ["a.b", "c"]."""
        if isinstance(v, str):
            v = [p.strip().strip("'\"") for p in v.strip().removeprefix("[").removesuffix("]").split(",")]
            v = [p for p in v if p]
        if isinstance(v, list):
            bad = [p for p in v if not isinstance(p, str) or not p or any(not part for part in p.split("."))]
            if bad:
                raise ValueError(f"resume.allow_changes takes dotted config keys (e.g. algo.lr), got {bad!r}")
        return v


class RunConfig(_Strict):
    env: EnvConfig = Field(default_factory=EnvConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    learner: LearnerEngineConfig = Field(default_factory=LearnerEngineConfig)
    resume: ResumeConfig = Field(default_factory=ResumeConfig, description="What a resumed run may change.")
    output_dir: str = Field("runs", description="Local folder for checkpoints, the MLflow store and rollouts.")
    run_name: str | None = Field(None, description="Run name; a run with the same name and config resumes.")
    preset: str | None = Field(None, description="Preset this config was built from.")
    seed: int = Field(0, description="Seeds task sampling, generation and the learner.")

    @model_validator(mode="after")
    def _consistent(self):
        episodes = self.rollout.tasks_per_step * self.rollout.samples_per_task
        if self.algo.mini_batches > episodes:
            raise ValueError(
                f"algo.mini_batches ({self.algo.mini_batches}) exceeds the episodes per step ({episodes}); "
                "lower algo.mini_batches or raise rollout.tasks_per_step / rollout.samples_per_task"
            )
        if self.algo.estimator in ("grpo", "rloo", "gigpo") and self.rollout.samples_per_task < 2:
            raise ValueError(
                f"{self.algo.estimator} needs rollout.samples_per_task >= 2 (a group of one has zero advantage): "
                "set it to 2 or more"
            )
        ln = self.learner
        if ln.engine == "deepspeed" and self.algo.optimizer != "adamw":
            raise ValueError(f"algo.optimizer={self.algo.optimizer} is the torch learner's: DeepSpeed builds its own "
                             "AdamW (set algo.optimizer=adamw, or learner.engine=torch)")
        if ln.engine == "deepspeed" and (self.algo.expert_coef > 0 or self.algo.expert_groups):
            raise ValueError("algo.expert_coef's relabels and algo.expert_groups' episodes are trained by the torch "
                             "learner: set learner.engine=torch, or turn them off")
        if self.algo.replay_solved and self.algo.estimator not in ("grpo", "rloo", "gigpo"):
            raise ValueError(f"algo.replay_solved gives groups without reward variance a gradient, which only a "
                             f"group-relative estimator (grpo, rloo, gigpo) leaves without one, not "
                             f"{self.algo.estimator!r}: set algo.replay_solved=0")
        if self.rollout.dynamic_sampling_rounds and self.algo.estimator not in ("grpo", "rloo", "gigpo"):
            raise ValueError(f"rollout.dynamic_sampling_rounds drops groups without reward variance, which only "
                             f"matters to a group-relative estimator (grpo, rloo, gigpo), not {self.algo.estimator!r}: "
                             "set rollout.dynamic_sampling_rounds=0")
        if ln.engine == "deepspeed" and self.algo.grad_dtype != "fp32":
            raise ValueError(f"algo.grad_dtype={self.algo.grad_dtype} is the torch learner's: DeepSpeed keeps its own "
                             "gradients (set algo.grad_dtype=fp32, or learner.engine=torch)")
        if ln.engine == "torch" and (ln.ranks > 1 or ln.offload_optimizer or ln.config_path):
            raise ValueError("learner.ranks / offload_optimizer / config_path need learner.engine=deepspeed")
        if ln.engine == "deepspeed" and (ln.ranks > 1 or ln.zero_stage == 3) and self.rollout.backend != "vllm":
            raise ValueError("a multi-rank or ZeRO-3 DeepSpeed learner shares no model with the generator: "
                             "set rollout.backend=vllm (or learner.ranks=1 with zero_stage <= 2)")
        if self.rollout.vllm_in_process is True and (ln.engine == "deepspeed" or self.rollout.backend != "vllm"):
            raise ValueError("rollout.vllm_in_process runs a vLLM engine beside the torch learner in one process: "
                             "it needs rollout.backend=vllm and learner.engine=torch")
        size = -(-episodes // self.algo.mini_batches)
        if self.algo.mini_batches > 1 and size * (self.algo.mini_batches - 1) >= episodes:
            raise ValueError(
                f"algo.mini_batches ({self.algo.mini_batches}) cannot split {episodes} episodes into that many "
                "non-empty mini-batches; lower algo.mini_batches")
        if self.curriculum.mode == "steps" and self.curriculum.gate != GateConfig():
            raise ValueError("curriculum.gate is set but curriculum.mode is 'steps': set curriculum.mode=gated "
                             "or drop the gate settings")
        if self.curriculum.mode == "gated":
            short = [i + 1 for i, p in enumerate(self.curriculum.phases) if p.steps < self.curriculum.gate.min_steps]
            if short:
                raise ValueError(f"gated curriculum: phases {short} have fewer steps (their maximum) than "
                                 f"curriculum.gate.min_steps ({self.curriculum.gate.min_steps}); raise their steps "
                                 "or lower min_steps")
        return self

    @model_validator(mode="after")
    def _hardware(self):
        r = self.rollout
        if r.tensor_parallel_size > 1 and r.backend != "vllm":
            raise ValueError("rollout.tensor_parallel_size shards the vLLM engine: set rollout.backend=vllm or leave "
                             "it at 1")
        if r.tensor_parallel_size > 1 and r.vllm_in_process is True:
            raise ValueError("rollout.tensor_parallel_size > 1 runs one vLLM worker per GPU in its own process: drop "
                             "rollout.vllm_in_process=true")
        if r.vllm_sleep and r.backend != "vllm":
            raise ValueError("rollout.vllm_sleep is vLLM's sleep mode: set rollout.backend=vllm or drop it")
        if (r.engines > 1 or r.engine_hosts) and r.backend != "vllm":
            raise ValueError("rollout.engines / rollout.engine_hosts run several vLLM engines: set rollout.backend=vllm "
                             "or leave rollout.engines at 1")
        if r.engines > 1 and r.vllm_in_process is True:
            raise ValueError("rollout.engines > 1 runs each engine in its own processes: drop "
                             "rollout.vllm_in_process=true")
        if r.engines > 1 and self.model.lora.enabled and self.model.lora.engine == "adapter":
            raise ValueError("rollout.engines > 1 syncs full weights to every engine: the adapter is merged into "
                             "them (model.lora.engine=merged or auto); a LoRA request is served by one engine only: "
                             "set rollout.engines=1 or model.lora.engine=auto")
        if r.engine_urls:
            if r.backend != "vllm":
                raise ValueError("rollout.engine_urls joins vLLM engines on other hosts: set rollout.backend=vllm")
            bad = [u for u in r.engine_urls if not re.fullmatch(r"https?://[^/\s:]+(:\d{1,5})?/?", u)]
            if bad:
                raise ValueError(f"rollout.engine_urls entry {bad[0]!r}: write http://HOST:PORT (the address "
                                 "`scalinginter engine-host` prints)")
            if len(set(u.rstrip("/") for u in r.engine_urls)) != len(r.engine_urls):
                raise ValueError("rollout.engine_urls names an engine twice")
            if len(r.engine_urls) >= r.engines:
                raise ValueError(f"rollout.engines={r.engines} counts every engine, the {len(r.engine_urls)} at "
                                 "rollout.engine_urls too, and the run keeps at least one on its own machine: set "
                                 f"rollout.engines={len(r.engine_urls) + 1} (or more)")
            if r.engine_sync == "broadcast":
                raise ValueError("rollout.engine_sync=broadcast reaches engines on this machine only (an NCCL group "
                                 "of this machine's GPUs); engines at rollout.engine_urls reload a folder: set "
                                 "rollout.engine_sync=auto, memory or folder")
            if r.engine_hosts:
                raise ValueError("rollout.engine_hosts plans engines the run would start on other hosts, "
                                 "rollout.engine_urls joins engines already serving there: name the hosts one way")
        if r.engine_sync_dir.startswith("s3://") and not r.engine_urls:
            raise ValueError("rollout.engine_sync_dir=s3://... hands weights to engines on other hosts "
                             "(rollout.engine_urls); engines on this machine load a local folder: drop it or add "
                             "rollout.engine_urls")
        if r.engine_sync_dir and not r.engine_urls and r.engine_sync != "folder":
            raise ValueError("rollout.engine_sync_dir is where the folder sync writes (engine_sync=folder, or "
                             "engine_urls): set rollout.engine_sync=folder or drop it")
        for h in r.engine_hosts:
            from core.engines import parse_engine_host

            parse_engine_host(h)
        if self.learner.nodes > 1 and r.backend != "vllm":
            raise ValueError("a DeepSpeed learner across nodes shares no model with the generator: set "
                             "rollout.backend=vllm")
        return self

    @model_validator(mode="after")
    def _lora(self):
        lo = self.model.lora
        if not lo.enabled:
            if lo != LoraConfig():
                raise ValueError("model.lora settings are given but model.lora.rank is 0 (LoRA off): set "
                                 "model.lora.rank (e.g. 16) or drop them")
            return self
        if self.learner.engine == "deepspeed" and self.learner.zero_stage == 3:
            raise ValueError("model.lora with the DeepSpeed learner runs on ZeRO 0-2 (the frozen base whole on each "
                             "rank, the adapters and their optimizer state data-parallel): set learner.zero_stage=2, "
                             "or learner.engine=torch")
        if lo.engine != "auto" and self.rollout.backend != "vllm":
            raise ValueError(f"model.lora.engine={lo.engine} says how a vLLM engine serves the adapter: set "
                             "rollout.backend=vllm or leave model.lora.engine at auto")
        return self

    @property
    def eval_turn_limit(self) -> int:
        return self.eval.turn_limit or self.curriculum.phases[-1].turn_limit


# Fields older versions wrote into configs (checkpoints' trainer_state.json, config.json) that were since
# retired: reading an old config drops them instead of refusing the whole config.
RETIRED_KEYS: tuple[str, ...] = ("fail_after_step",)  # now the SCALINGINTER_FAULT_AFTER_STEP test hook


def stored_config(data: dict[str, Any]) -> "RunConfig":
    """A ``RunConfig`` from a config an earlier run stored (retired top-level keys dropped); raises
    pydantic's ValidationError when it still does not validate."""
    return RunConfig.model_validate({k: v for k, v in data.items() if k not in RETIRED_KEYS})


class ConfigError(ValueError):
    """A bad config value, with a message that says how to fix it."""


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a","b","c"], value); value parsed as JSON when it is JSON, else a string."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {item!r} (example: --set rollout.temperature=0.7)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set has an empty key in {item!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.split("."), value


def build_config(env: str, preset: str | None = None, overrides: list[str] | None = None,
                 extra: dict[str, Any] | None = None,
                 presets: Mapping[str, dict[str, Any]] | None = None) -> RunConfig:
    """The run config: ``presets[preset]`` (the env's presets, passed in as data), then ``extra``, then the
    ``key.path=value`` overrides, validated. ``flows.config.build_config`` looks the env's presets up."""
    data: dict[str, Any] = {}
    if preset is not None:
        if presets is None:
            raise ConfigError(f"preset {preset!r} named but no presets given: pass presets=envs.base.env_presets"
                              f"({env!r}) or call flows.config.build_config, which looks them up")
        if preset not in presets:
            raise ConfigError(f"unknown preset {preset!r} for env {env!r}; available: {', '.join(presets) or 'none'}")
        data = deep_merge(data, copy.deepcopy(presets[preset]))
        data["preset"] = preset
    data = deep_merge(data, {"env": {"name": env}})
    if extra:
        data = deep_merge(data, copy.deepcopy(extra))
    for item in overrides or []:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
        node[path[-1]] = value
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "config"
            lines.append(f"  {loc}: {err['msg']}")
        raise ConfigError("invalid config:\n" + "\n".join(lines)) from None
