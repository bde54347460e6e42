"""`Args`: every flag of train.py, with its default (the ScaleRL recipe of §4, at a CPU's scale)
and its docstring, which tyro prints as the `--help` text.

    python train.py --help                   # every flag with its default and docstring

Paper: §4 (the ScaleRL recipe: the defaults), §3.1-3.2 and A.3-A.10 (each choice, cited on its
field). config.parse_args lays the --model preset and the --recipe over these defaults
(presets.py) and config.validate checks them; train.py reads them. Exercised by
`python -m pytest tests/test_train.py -k "recipes or bad"`.

Where this departs from the paper, and why:
1. The sizes default to a CPU run of the tiny model (presets.py's "tiny" row adjusts them); the
   paper's values are given on each field and set by the qwen3 presets.
"""

from dataclasses import dataclass
from typing import Literal

# from-imports: inside Args the name `data` is a field, not the module
from arith import ARITH_THINK_BUDGET
from data import PHRASE  # the interruption phrase (paper v1 §4)


@dataclass
class Args:
    """ScaleRL training (arXiv 2510.13786). Defaults: the recipe of §4 at the scale of --model's
    preset."""

    # --- run, seed, logging
    run_dir: str | None = None
    """run directory (default: runs/<model>-<recipe>-<date>); holds metrics.jsonl, samples.jsonl,
    checkpoints"""
    resume: str | None = None
    """continue the run in this directory from its last checkpoint (from step 0 if it has none
    yet); its saved args are the defaults"""
    seed: int = 0
    """prompt order, held-out split, initialization, sampler seed"""
    steps: int = 80
    """optimizer steps in all"""
    eval_every: int = 8
    """held-out evaluation (and a sigmoid fit) every this many steps; also at step 0 and at the
    end"""
    eval_size: int = 96
    """held-out prompts of each task (paper: 1,000), removed from training"""
    eval_n: int = 4
    """samples per held-out prompt (paper: 16); the pass rate is their mean"""
    save_every: int = 50
    """checkpoint every this many steps (and on Ctrl-C); 0: only at the end"""
    log_samples: int = 4
    """completions per step written to samples.jsonl"""
    wandb_project: str | None = None
    """also log to Weights & Biases (needs `pip install wandb`)"""
    dist_timeout: float = 1800.0
    """seconds a rank may wait in one collective before torch.distributed calls it hung; rank 0's
    long waits (vLLM starting, rollouts, evals) keep the other ranks polling every second"""
    # --- model and devices
    model: str = "tiny"
    """preset (tiny, smollm2-135m, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b), Hugging Face id or
    local dir"""
    path: str | None = None
    """weights to start from (default: the preset's; `tiny` builds its own)"""
    generator_gpus: list[int] | None = None
    """GPUs for vLLM, tp x dp of them, as indices into the visible ones (CUDA_VISIBLE_DEVICES
    order); default: every visible GPU of rank 0's node that no trainer rank uses"""
    eval_gpus: int | None = None
    """generator GPUs (the last ones) for the eval engine, which evaluates while training goes on;
    0: it shares the generator's GPU(s); default: tensor_parallel_size GPUs when the generator has
    at least twice that, else 0"""
    share_gpu: bool = False
    """let vLLM share trainer GPUs (default: rank 0's), small models only; weights go via disk"""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism; the generator GPUs form dp engines of tp GPUs each"""
    gpu_memory_utilization: float | None = None
    """vLLM's share of each generator GPU (default: 0.9 on its own GPUs, 0.5 on a shared one)"""
    weight_transfer: Literal["auto", "disk", "nccl"] = "auto"
    """how weights reach vLLM: auto = NCCL when vLLM has GPUs of its own (CUDA), else disk"""
    kv_cache_gib: float | None = None
    """vLLM KV cache size on CPU"""
    activation_checkpointing: bool = False
    """recompute each decoder layer's activations in backward (the GPU presets from 1.7b up)"""
    gen_dtype: str = "auto"
    """vLLM weights dtype ("auto": bf16 on GPU)"""
    max_model_len: int = 512
    """vLLM context: prompt + thinking + phrase + answer must fit"""
    # --- data
    data: str = "arith"
    """dataset: preset (arith, arith-hard, gsm8k, polaris, math500; code: humaneval, deepcoder),
    a mixture a+b of tasks a and b (e.g. polaris+deepcoder), local .jsonl/.json/.parquet, or a hub
    id"""
    task_weights: list[str] | None = None
    """a mixture's sampling: TASK=WEIGHT for each task (e.g. polaris=1 deepcoder=1); a group's
    prompt is of task t with probability w_t / sum(w); default: each task's number of prompts"""
    unsafe_no_sandbox: bool = False
    """grade code WITHOUT the bubblewrap sandbox (no user namespaces here): it sees your files"""
    question_key: str | None = None
    """column holding the question (default: question / problem / prompt)"""
    answer_key: str | None = None
    """column holding the gold answer (default: answer / solution / final_answer)"""
    max_prompt_len: int = 128
    """prompts longer than this after templating are skipped (counted)"""
    # --- generation
    prompts_per_step: int = 16
    """P: prompt groups per optimizer step (paper: 48)"""
    group_size: int = 8
    """G: completions per prompt (paper: 16)"""
    temperature: float = 1.0
    """sampling temperature of training and evaluation; the trainer divides logits by it too"""
    thinking: Literal["auto", "on", "off"] = "auto"
    """<think>...</think> before the answer; auto: iff the chat template renders a think block"""
    think_budget: tuple[int, int] = ARITH_THINK_BUDGET
    """forced interruption after L ~ U[lo, hi] thinking tokens (paper A.10: 10k-12k)"""
    answer_budget: int = 16
    """tokens for the answer after thinking (paper: 2k)"""
    interruptions: bool = True
    """forced interruptions (§2); off: one phase of think_budget[1] + answer_budget tokens
    (loo-lp)"""
    phrase: str = PHRASE
    """appended when the thinking budget runs out (paper §4)"""
    gen_timeout: float | None = None
    """seconds a group may take to be sampled and scored before the run stops as hung (default:
    scaled from the budgets and the sequences in flight, pipeline.group_timeout)"""
    async_mode: Literal["pipeline", "ppo"] = "pipeline"
    """PipelineRL-k with in-flight updates (§3.1) or PPO-off-policy-k (k batches per weight
    version)"""
    max_lag: int = 8
    """k: the most trainer steps a batch's oldest token may lag (paper: 8); 0 = synchronous
    on-policy"""
    # --- filters
    zero_var_filter: bool = True
    """drop groups whose rewards are all equal from the loss (§3.2 "effective batch")"""
    prompt_sampling: Literal["no_positive", "uniform"] = "no_positive"
    """No-Positive-Resampling (retire prompts with pass rate >= npr_threshold) or uniform epochs"""
    npr_threshold: float = 0.9
    """pass rate at which No-Positive-Resampling retires a prompt (paper: 0.9)"""
    length_penalty: bool = False
    """DAPO overlong penalty on correct rollouts (A.10 Eq. 9; loo-lp)"""
    # --- loss
    recipe: str = "scalerl"
    """flag bundle: scalerl, deepseek-grpo, qwen2.5-dapo, magistral, minimax, loo-plan, loo-lp,
    loo-batch, loo-8op, loo-fp32, loo-savg, loo-dapo, loo-uniform"""
    loss: Literal["cispo", "gspo", "dapo", "grpo"] = "cispo"
    """policy loss (§3.2)"""
    agg: Literal["prompt", "sample", "token"] = "prompt"
    """loss aggregation (§3.2, A.9)"""
    adv_norm: Literal["batch", "prompt", "none"] = "batch"
    """advantage normalization (§3.2, A.9)"""
    cispo_cap: float = 4.0
    """CISPO truncation of the IS ratio (paper: one of 4, 5, 8)"""
    eps_low: float = 0.2
    """DAPO / GRPO lower clip"""
    eps_high: float = 0.28
    """DAPO / GRPO upper clip"""
    fp32_head: bool = True
    """LM head in fp32 in sampler and trainer (§3.2); off: the model dtype (bf16 on GPU; no-op on
    CPU)"""
    # --- optimizer
    lr: float = 1e-4
    """AdamW learning rate, constant after warmup (paper: 5e-7 for 8B)"""
    warmup_steps: int = 5
    """linear LR warmup (paper: 100)"""
    weight_decay: float = 0.01
    """AdamW weight decay (paper A.3: 0.01)"""
    adam_eps: float = 1e-15
    """paper A.3: 1e-15, against epsilon underflow"""
    max_grad_norm: float = 1.0
    """gradient clipping (the paper does not say)"""
    max_tokens_per_microbatch: int = 32768
    """tokens per forward/backward on each rank, as computed: padded rows x their longest (SDPA,
    eager), or the sum of the lengths of a packed row (flash attention); a longer sequence runs
    alone. 0: micro-batches of --micro-batch-size sequences padded to the batch's longest (the
    layout before issue 11)"""
    micro_batch_size: int = 128
    """at most this many sequences per forward/backward on each rank"""
    batch_scale: float = 1.0
    """multiplies prompts_per_step (the DAPO and MiniMax recipes ran 80 prompts instead of 48)"""
