"""What a run starts from: the model (a preset built here, a directory or a hub id), its tokenizer
and thinking mode, the prompts with their reward functions, each checked before anything is
written, so that a bad input costs one line and no run directory (issue 13); then the placement,
the fp32 weights, and once the run directory exists, the held-out split and the prompt pool.

    python train.py --data nope.jsonl    # train.py: --data nope.jsonl: no such file (exit 1)

The model is loaded with every dropout probability of its config at 0 (RL trainers compute
log-probs with dropout off; the policy stays in train mode, which transformers' activation
checkpointing needs), and refused in one line where the trainer's head cannot be the model's own:
logit soft-capping or a bias on its LM head (logit_scale), or no decoder layers to shard
(decoder_layers).

Every function here is called on every rank; rank 0 builds the tiny model and prints.
"""

import collections
import dataclasses
import functools

import psutil
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

import config
import filters
from config import Args, BadInput
from infra import placement
from infra.launch import plan_placement
from tasks import code_reward, data, heldout, math_reward, sandbox, tiny

# The causal-LM heads that scale hidden @ W.T by a config value, by the text config's model_type:
# logits = hidden @ W.T * config.FIELD ** POWER (transformers 5.19 *ForCausalLM.forward; vLLM 0.32
# passes the same factor to its LogitsProcessor(scale=...)). MiniCPM3 divides the hidden state by
# its logits_scaling property, the same factor on the logits.
LOGIT_SCALES = {
    "cohere": ("logit_scale", 1),
    "cohere2": ("logit_scale", 1),
    "cohere2_moe": ("logit_scale", 1),
    "granite": ("logits_scaling", -1),
    "granitemoe": ("logits_scaling", -1),
    "granitemoeshared": ("logits_scaling", -1),
    "granitemoehybrid": ("logits_scaling", -1),
    "granite_swa": ("logits_scaling", -1),  # vLLM 0.32 serves it as Granite
    "granitemoe_swa": ("logits_scaling", -1),  # vLLM 0.32 serves it as GraniteMoeShared
    "hyperclovax": ("logits_scaling", 1),  # muP: a multiplier here, a divisor in Granite
    "falcon_h1": ("lm_head_multiplier", 1),
    "minicpm3": ("logits_scaling", -1),
}
# MoE routers whose forward is transformers 5.19's Qwen3MoeTopKRouter: (router_logits (n, E),
# top-k softmax probabilities (renormalised if norm_topk_prob), top-k expert ids (n, k)), which
# replay_routing's hook rewrites; pinned by tests/test_routing.py
MOE_ROUTERS = ("Qwen3MoeTopKRouter",)
# config fields of a tanh soft cap on the final logits (Gemma 2/3/3n/4, VaultGemma, NanoChat;
# RecurrentGemma): cap * tanh(logits / cap), which token_logprobs does not compute
SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap")


def head_scale(model_config) -> float:
    """The factor the model's own causal-LM head multiplies hidden @ W.T by (LOGIT_SCALES; 1.0 for
    a plain head), read from its config, which train.Policy folds into the temperature:
    log_softmax(logits * s / T) is what vLLM samples from. Raises ValueError naming the config
    field for a head that does more than that, which the fp32 head (loss.token_logprobs) would
    skip, so that the trainer's log-probs would not be the sampler's (issue 26): logit soft-capping
    (SOFTCAP_FIELDS, when set), or a logit_scale that vLLM applies and transformers does not.
    Config only: load_model refuses such a model before loading its weights."""
    text = model_config.get_text_config()
    for field in SOFTCAP_FIELDS:
        cap = getattr(text, field, None)
        if cap is not None:
            raise ValueError(
                f"{field} {cap}: the trainer's fp32 head has no logit soft-capping, so its "
                "log-probs would not be the sampler's; not supported"
            )
    field, power = LOGIT_SCALES.get(text.model_type, (None, 0))
    if field is None:
        # vLLM 0.32's Llama and the families built on it (llama.py, exaone, nemotron, solar, ...)
        # multiply their logits by a config's logit_scale, which transformers' forward ignores
        extra = getattr(text, "logit_scale", None)
        if extra is not None and extra != 1:
            raise ValueError(
                f"logit_scale {extra}: vLLM 0.32 scales this model's logits by it and its "
                "transformers forward does not, so the sampler's log-probs would not be the "
                "trainer's; not supported"
            )
        return 1.0
    return float(getattr(text, field)) ** power


def logit_scale(lm) -> float:
    """`head_scale` of a loaded model, which also must have no bias on its LM head (GPT-J's,
    Phi-3.5-MoE's): the fp32 head would neither apply nor train it. Raises ValueError naming the
    field or module."""
    head = lm.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(
            f"its LM head has a bias ({type(lm).__name__}), which the trainer's fp32 head would "
            "neither apply nor train; not supported"
        )
    return head_scale(lm.config)


def router_experts(model_config) -> tuple[int, int] | None:
    """(experts, experts per token) of a mixture-of-experts config (Qwen3-MoE's num_experts and
    num_experts_per_tok; Mixtral's num_local_experts), None for a dense one."""
    text = model_config.get_text_config()
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    if not experts:
        return None
    return experts, text.num_experts_per_tok


def decoder_layers(lm) -> list:
    """The modules train.shard wraps one by one: those whose class the model names in
    _no_split_modules (its decoder layers; what transformers' Trainer and accelerate wrap for FSDP),
    the outermost where one holds another, in model order. Found this way wherever a family
    keeps them: Qwen3 and Llama at model.layers, GPT-2 and GPT-J at transformer.h, OPT at
    model.decoder.layers. Raises ValueError when the model names none that it has. _no_split_modules
    is transformers' own attribute (5.19: the set over the model's submodules' classes);
    tests/test_models.py fails if it stops naming the layers."""
    classes = set(lm._no_split_modules or ())
    layers = []
    kept = []  # the names of the modules taken, whose submodules are inside them already
    for name, module in lm.named_modules():
        if type(module).__name__ not in classes:
            continue
        if any(name.startswith(k + ".") for k in kept):
            continue
        layers.append(module)
        kept.append(name)
    if not layers:
        raise ValueError(
            f"no decoder layers to shard: {type(lm).__name__} has no module of a class in its "
            f"_no_split_modules ({', '.join(sorted(classes)) or 'none'}); not supported"
        )
    return layers


def moe_routers(lm) -> list:
    """The model's MoE routers (modules of a class in MOE_ROUTERS), in layer order: the layers axis
    of a rollout's routes (generate.Completion.routes, vLLM's MoE layers in the same order)."""
    return [m for m in lm.modules() if type(m).__name__ in MOE_ROUTERS]


def replay_routing(lm, routes_of) -> int:
    """Rollout routing replay (R3, arXiv 2510.11370; issue 27, `--routing-replay`): a forward hook
    on each MoE router (moe_routers) that routes each token to the experts vLLM chose for it, where
    known. `routes_of()` gives the current forward's routes, (n, layers, k) integer, n = the
    decoder's flattened tokens (rows x columns, the order of transformers' MoE block), -1 where
    vLLM computed none, or None (the trainer routes itself). Per token and layer: selected experts
    = vLLM's where all k are known, else the router's own top-k; gating weights = the router's own
    softmax probabilities at those experts, renormalised where the config says norm_topk_prob (as
    the router does), so gradients still reach the router's weight through its logits. With the
    router's own routes it returns exactly what the router did (the same gather of the same
    probabilities). The hooks stay for the model's life, so activation checkpointing's recompute
    in backward replays too. Returns the routers hooked (0: a dense model)."""
    routers = moe_routers(lm)
    for layer, router in enumerate(routers):

        def hook(module, args, out, layer=layer):
            routes = routes_of()
            if routes is None:
                return out
            logits, _, own = out  # (n, E), (n, k), (n, k)
            given = routes[:, layer].to(own.dtype)  # (n, k)
            known = (given >= 0).all(-1, keepdim=True)  # (n, 1)
            experts = torch.where(known, given, own)  # (n, k)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # (n, E), as the router
            weights = probs.gather(1, experts)  # (n, k)
            if module.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), experts

        router.register_forward_hook(hook)
    return len(routers)


def without_dropout(config) -> None:
    """Set every dropout probability of a transformers config and its sub-configs to 0, in place:
    every float field whose name has "drop" in it (attention_dropout, dropout, resid_pdrop,
    layerdrop, drop_path_rate, ...). RL trainers compute log-probs with dropout off, and with it on
    two calls on the same tokens differ (OPT's 0.1: by ~0.05 per token), so rho would be noise
    even at equal weights. Done in the config, before the model is built, rather than by eval mode,
    because transformers checkpoints activations only in train mode (issue 26). The config the run
    exports with its weights (checkpoint.export_pretrained) says 0 too: the model as trained."""
    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            without_dropout(value)
        elif "drop" in key and isinstance(value, float) and value > 0:
            setattr(config, key, 0.0)


def reward_fns(prompts, unsafe_no_sandbox: bool) -> dict:
    """The reward function of each kind (data.Prompt.kind) among `prompts`, for the pipeline:
    math-verify for math, the problem's unit tests run in a bubblewrap sandbox for code. Raises
    BadInput (code 1) with sandbox.check's one-line error when code is present and no sandbox can
    be made here; --unsafe-no-sandbox runs code without one, with a warning at every start."""
    fns = {"math": math_reward.math_rewards}
    if any(p.kind == "code" for p in prompts):
        try:
            sandbox.check(sandboxed=not unsafe_no_sandbox)
        except RuntimeError as e:
            raise BadInput(str(e), 1) from None
        fns["code"] = functools.partial(code_reward.code_rewards, sandboxed=not unsafe_no_sandbox)
    return fns


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def hub_model(repo: str) -> str:
    """A hub model's cached snapshot directory (no network needed), else `repo` once one quick
    request has shown the hub serves it; without this, transformers retries an unreachable hub for
    about a minute. Raises BadInput (code 1) when the model is neither cached nor reachable."""
    from huggingface_hub import constants, model_info, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return snapshot_download(repo, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise BadInput(
            f"--model {repo}: not in the local Hugging Face cache (HF_HUB_OFFLINE is set)", 1
        )
    try:
        model_info(repo, timeout=10)
    except RepositoryNotFoundError as e:  # gated and private repos too
        raise BadInput(
            f"--model {repo}: no such model on the Hugging Face hub, or HF_TOKEN needed", 1
        ) from e
    except Exception as e:  # the hub client's connection errors
        why = f"not in the local Hugging Face cache, and the hub is unreachable ({one_line(e)})"
        raise BadInput(f"--model {repo}: {why}", 1) from e
    return repo


def model_path(args: Args, master: bool) -> str:
    """The model directory or hub id: --model's path, else the tiny model or its MoE twin (built
    once and cached; rank 0 builds, the others wait) or SmolLM2. A hub id is resolved to its
    cached snapshot (hub_model). Raises BadInput (code 1)."""
    path = [args.path, None]  # the model directory or hub id, and rank 0's error building it
    if path[0] is None and master:
        try:
            if args.model in ("tiny", "tiny-moe"):
                path[0] = tiny.build(seed=args.seed, moe=args.model == "tiny-moe")
            else:
                path[0] = tiny.smollm2()
        except RuntimeError as e:  # smollm2 without its packages: the message gives the pip command
            path[1] = str(e)
    dist.broadcast_object_list(path)
    if path[1] is not None:
        raise BadInput(path[1], 1)
    if config.model_kind(path[0]) == "hub":
        return hub_model(path[0])
    return path[0]


def load_tokenizer(args: Args, path: str, master: bool):
    """(tokenizer, thinking): whether the model thinks is read from its chat template
    (data.thinking_mode) unless --thinking forces it, and printed. Raises BadInput naming the flag
    (code 1; 2 for --thinking)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise BadInput(f"--model {args.model}: cannot load its tokenizer: {one_line(e)}", 1) from e
    try:
        thinking = data.thinking_mode(tokenizer, args.thinking)  # the template's, unless forced
    except ValueError as e:
        raise BadInput(f"--thinking {args.thinking}: {one_line(e)}", 2) from e
    if master:
        how = "from the chat template" if args.thinking == "auto" else "forced"
        said = "on" if thinking else "off"
        print(f"thinking {said} (--thinking {args.thinking}: {how})", flush=True)
    return tokenizer, thinking


def load_prompts(args: Args, tokenizer, thinking: bool) -> list:
    """--data's prompts (data.load_prompts), checked against --eval-size (held out per task) and
    --task-weights. Raises BadInput (code 1) naming the flag and its value."""
    try:
        prompts = data.load_prompts(
            args.data,
            tokenizer,
            thinking=thinking,
            max_prompt_len=args.max_prompt_len,
            question_key=args.question_key,
            answer_key=args.answer_key,
            seed=args.seed,
        )
    except (OSError, ValueError, ImportError) as e:  # data.py's messages start with the source
        msg = one_line(e)
        if not msg.startswith(args.data):
            msg = f"{args.data}: {msg}"
        raise BadInput(f"--data {msg}", 1) from e
    tasks = collections.Counter(p.task for p in prompts)
    task, n = min(tasks.items(), key=lambda item: item[1])
    if args.eval_size >= n:  # held out per task (heldout.split_heldout)
        of = f"task {task} of --data {args.data}" if len(tasks) > 1 else f"--data {args.data}"
        raise BadInput(
            f"--eval-size {args.eval_size}: must be less than the {n} prompts of {of}", 1
        )
    try:
        filters.task_weights(list(tasks), config.parse_task_weights(args.task_weights))
    except ValueError as e:
        raise BadInput(f"--task-weights {' '.join(args.task_weights)}: {e}", 1) from e
    return prompts


@dataclasses.dataclass
class Inputs:
    """What a run starts from, loaded and checked before anything is written (load_inputs)."""

    path: str  # the model directory or hub id
    tokenizer: object
    prompts: list  # data.Prompt, every task's, before the held-out split
    thinking: bool  # the chat template's thinking mode, or --thinking's
    reward_fn: dict  # data.Prompt.kind -> reward function (reward_fns)
    P: int  # prompt groups per step: --prompts-per-step x --batch-scale
    gen_dtype: torch.dtype  # the sampler's weights (sampler_dtype)
    plan: placement.Plan  # trainer ranks, vLLM engines, their GPUs and memory
    lm: torch.nn.Module  # the fp32 master weights
    n_params: int  # all of them (memory, weight transfers)
    n_active: int  # those one token runs through (FLOPs): an MoE's routed experts only


def load_inputs(args: Args, world: int, device) -> Inputs:
    """Model path, tokenizer, prompts and their reward functions, each checked before the run
    directory exists, so that a failed start leaves nothing behind (issue 13); then the placement
    (which refuses before the model loads) and the model's fp32 weights. Raises BadInput (code 1;
    2 for --thinking) naming the flag and its value."""
    master = dist.get_rank() == 0
    if master and device.type != "cuda" and config.model_kind(args.model) in ("dir", "hub"):
        cpu = ", ".join(f"{k} {getattr(args, k)}" for k in config.PRESETS["hf-cpu"] if k != "path")
        print(f"--model {args.model} without CUDA: CPU-sized defaults ({cpu}); flags override them")
    path = model_path(args, master)
    tokenizer, thinking = load_tokenizer(args, path, master)
    prompts = load_prompts(args, tokenizer, thinking)
    reward_fn = reward_fns(prompts, args.unsafe_no_sandbox)  # before any slow setup: it may exit
    gen_dtype = sampler_dtype(args, device)
    P = config.groups_per_step(args)
    n_tasks = len({p.task for p in prompts}) if prompts else 1  # each holds out eval_size prompts
    plan = plan_placement(args, path, world, gen_dtype, P, n_tasks)
    if device.type != "cuda":  # the training and the eval engine, each its KV cache
        check_cpu_memory(int((args.kv_cache_gib or placement.CPU_KV_CACHE_GIB) * 2**30), 2)
    lm = load_model(args, path)
    n_params = sum(p.numel() for p in lm.parameters())
    n_active = n_params - placement.inactive_params(lm.config.get_text_config())
    return Inputs(
        path, tokenizer, prompts, thinking, reward_fn, P, gen_dtype, plan, lm, n_params, n_active
    )


def check_cpu_memory(kv_cache_bytes: int, caches: int = 1) -> None:
    """Raises BadInput (code 1), one line, when `caches` KV caches of `kv_cache_bytes` each (a CPU
    engine's workers; train.py's two engines) exceed the memory free now (psutil's available):
    what was asked, what is free, the flag to lower. vLLM 0.32's cpu_worker makes the same check
    against its NUMA node inside the engine-core process, where failing costs a page of worker
    tracebacks; this one runs before any engine starts (here at load, and in `engine.Engine`)."""
    asked = kv_cache_bytes * caches
    free = psutil.virtual_memory().available
    if asked > free:
        raise BadInput(
            f"--kv-cache-gib {kv_cache_bytes / 2**30:g}: {caches} vLLM KV cache(s) on CPU ask for "
            f"{asked / 2**30:.1f} GiB, only {free / 2**30:.1f} GiB of memory is free: lower "
            "--kv-cache-gib (or free memory)",
            1,
        )


def pad_token_id(tokenizer) -> int:
    """The id that pads the trainer's batch (masked, never trained): pad, else EOS, else 0."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id or 0


def sampler_dtype(args: Args, device) -> torch.dtype:
    """The sampler's weights: bf16 on GPU, fp32 on CPU for --gen-dtype auto (vLLM's own "auto" would
    pick bf16 there too, and the trainer is fp32), else the dtype named."""
    if args.gen_dtype != "auto":
        return getattr(torch, args.gen_dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(args: Args, path: str):
    """The fp32 master weights (seeded by --seed), built with dropout off (without_dropout). Raises
    BadInput (code 1) naming --model: weights that do not load, a head the trainer cannot compute
    as the model does (logit_scale), no decoder layers to shard (decoder_layers); naming
    --router-aux-loss-coef when it is > 0 on a model with no router (router_experts)."""
    torch.manual_seed(args.seed)
    try:
        model_config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise BadInput(f"--model {args.model}: cannot load its weights: {one_line(e)}", 1) from e
    try:
        head_scale(model_config)  # before the weights: a refused model is never loaded
    except ValueError as e:
        raise BadInput(f"--model {args.model}: {e}", 1) from None
    if args.router_aux_loss_coef and router_experts(model_config) is None:
        raise BadInput(
            f"--router-aux-loss-coef {args.router_aux_loss_coef}: --model {args.model} is not a "
            "mixture of experts (no router to balance); leave it at 0",
            1,
        )
    try:
        without_dropout(model_config)
        lm = AutoModelForCausalLM.from_pretrained(path, config=model_config, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise BadInput(f"--model {args.model}: cannot load its weights: {one_line(e)}", 1) from e
    try:
        logit_scale(lm)
        decoder_layers(lm)
    except ValueError as e:
        raise BadInput(f"--model {args.model}: {e}", 1) from None
    if args.routing_replay and not moe_routers(lm):
        raise BadInput(
            f"--routing-replay: --model {args.model} has no MoE router "
            f"({', '.join(MOE_ROUTERS)}) to replay",
            1,
        )
    return lm


def heldout_and_pool(args: Args, prompts: list, run_dir: str, master: bool):
    """(train_prompts, eval_prompts, pool): rank 0 draws (or, resuming, restores) the held-out split
    of eval_size prompts per task (heldout.split_heldout, heldout.json); the others then read it.
    --train-size keeps train_size training prompts of each task, drawn by --seed.
    The pool (filters.prompt_pool): one PromptPool per task, tasks drawn by --task-weights, prompts
    by No-Positive-Resampling (§3.2) or in uniform epochs."""
    for turn in (master, not master):
        if turn:
            train_prompts, eval_prompts = heldout.split_heldout(
                prompts, args.eval_size, seed=args.seed, run_dir=run_dir, train_size=args.train_size
            )
        dist.barrier()
    pool = filters.prompt_pool(
        [p.task for p in train_prompts],
        config.parse_task_weights(args.task_weights),
        threshold=args.npr_threshold,
        policy=args.prompt_sampling,
        seed=args.seed,
    )
    return train_prompts, eval_prompts, pool
