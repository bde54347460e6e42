"""The models a user brings (issue 26): for each family vLLM 0.32 serves whose causal-LM head does
more than hidden @ W.T, a tiny random model (built here from its transformers 5.19 config, saved,
then loaded by loading.load_model and wrapped by train.build as a run does) either gets the model's
own log-probs from the policy (max |delta logp| <= 1e-4 in fp32 against log_softmax of its own
forward's logits: Cohere's (1, 2, 2-MoE) logit_scale, Granite's (dense, MoE, MoE-shared, MoE-hybrid,
SWA, MoE-SWA) and MiniCPM3's logits_scaling divisor, HyperCLOVAX's multiplier, Falcon-H1's
lm_head_multiplier, Gemma 3 without a soft cap) or is refused in one line naming the config field or
module (Gemma 2/3/3n/4's final_logit_softcapping, GPT-J's and PhiMoE's head bias), also through
train.py itself (exit 1, no traceback, no run directory). Decoder layers are found where each family
keeps them (GPT-2 at transformer.h, OPT at model.decoder.layers). Dropout in a config (OPT's 0.1,
GPT-2's pdrops) is off in the trainer: two log-prob calls on the same tokens agree bit for bit,
gradients reach every layer and activation checkpointing still recomputes each layer in backward."""

import os
import subprocess
import sys

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import config
import train
from infra import loading
from tasks import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 261  # the byte tokenizer's ids (tiny.build_tokenizer), so train.py can load these models
LLAMA_LIKE = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
    initializer_range=0.5,  # logits of a few nats, so that a missed scale shows
    pad_token_id=256,
    bos_token_id=257,
    eos_token_id=258,
)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
# family -> its config class and the values that make it tiny and its head factor far from 1
EXACT = {
    "qwen3": ("Qwen3Config", {}),
    "gemma3_text": ("Gemma3TextConfig", dict(final_logit_softcapping=None)),
    "cohere": ("CohereConfig", dict(logit_scale=3.0)),
    "cohere2": ("Cohere2Config", dict(logit_scale=3.0)),
    "granite": ("GraniteConfig", dict(logits_scaling=0.25)),
    "granitemoe": ("GraniteMoeConfig", dict(logits_scaling=0.25, **MOE)),
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(logits_scaling=0.25, **MOE)),
    "granitemoehybrid": (  # one Mamba-2 layer, one attention layer; 4 heads of 16 = 2 x 32
        "GraniteMoeHybridConfig",
        dict(
            logits_scaling=0.25,
            shared_intermediate_size=64,
            layer_types=["linear_attention", "full_attention"],
            mamba_n_heads=4,
            mamba_d_state=16,
            mamba_chunk_size=16,
            **MOE,
        ),
    ),
    "granite_swa": (  # one full-attention layer, one sliding-window
        "GraniteSWAConfig",
        dict(logits_scaling=0.25, sliding_window=8),
    ),
    "granitemoe_swa": ("GraniteMoeSWAConfig", dict(logits_scaling=0.25, sliding_window=8, **MOE)),
    "cohere2_moe": (  # one sliding-window layer, one full
        "Cohere2MoeConfig",
        dict(
            logit_scale=3.0,
            num_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            sliding_window_pattern=2,
        ),
    ),
    "hyperclovax": ("HyperCLOVAXConfig", dict(logits_scaling=3.0)),
    "falcon_h1": (
        "FalconH1Config",
        dict(lm_head_multiplier=3.0, mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16),
    ),
    "minicpm3": (  # hidden / (32 / 128): logits x 4; MLA at small ranks
        "MiniCPM3Config",
        dict(
            dim_model_base=128,
            num_key_value_heads=2,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
        ),
    ),
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=2, n_positions=64)),
    "opt": (
        "OPTConfig",
        dict(ffn_dim=64, word_embed_proj_dim=32, dropout=0.1, attention_dropout=0.1),
    ),
}
# where transformers 5.19 keeps each family's decoder layers
LAYERS = {"gpt2": "transformer.h", "opt": "model.decoder.layers", "qwen3": "model.layers"}
# family -> config class, values, and the one line load_model gives (after "--model DIR: ")
SOFTCAP = (
    "{field} 30.0: the trainer's fp32 head has no logit soft-capping, so its log-probs would not "
    "be the sampler's; not supported"
)
REFUSED = {
    "gemma2": ("Gemma2Config", {}, SOFTCAP.format(field="final_logit_softcapping")),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(final_logit_softcapping=30.0),
        SOFTCAP.format(field="final_logit_softcapping"),
    ),
    "gemma4_text": (
        "Gemma4TextConfig",
        dict(
            final_logit_softcapping=30.0,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=V,
        ),
        SOFTCAP.format(field="final_logit_softcapping"),
    ),
    "gemma3n_text": (  # no KV sharing across 2 layers; AltUp, LAuReL and per-layer inputs small
        "Gemma3nTextConfig",
        dict(
            final_logit_softcapping=30.0,
            num_kv_shared_layers=0,
            laurel_rank=4,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=V,
            sliding_window=8,
        ),
        SOFTCAP.format(field="final_logit_softcapping"),
    ),
    "vaultgemma": ("VaultGemmaConfig", {}, SOFTCAP.format(field="final_logit_softcapping")),
    "recurrent_gemma": (  # one recurrent block and one attention block, their widths tiny
        "RecurrentGemmaConfig",
        dict(
            block_types=["recurrent", "attention"],
            lru_width=32,
            attention_window_size=8,
            conv1d_width=4,
        ),
        SOFTCAP.format(field="logits_soft_cap"),
    ),
    "nanochat": (
        "NanoChatConfig",
        {},
        "final_logit_softcapping 15.0: the trainer's fp32 head has no logit soft-capping, so its "
        "log-probs would not be the sampler's; not supported",
    ),
    "phimoe": (  # Phi-3.5-MoE's lm_head_bias; vLLM 0.32 loads the bias but never adds it
        "PhimoeConfig",
        dict(lm_head_bias=True, **MOE),
        "its LM head has a bias (PhimoeForCausalLM), which the trainer's fp32 head would neither "
        "apply nor train; not supported",
    ),
    "llama": (  # vLLM 0.32's llama.py multiplies its logits by it; transformers' Llama does not
        "LlamaConfig",
        dict(logit_scale=2.0),
        "logit_scale 2.0: vLLM 0.32 scales this model's logits by it and its transformers forward "
        "does not, so the sampler's log-probs would not be the trainer's; not supported",
    ),
    "gptj": (
        "GPTJConfig",
        dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, rotary_dim=8),
        "its LM head has a bias (GPTJForCausalLM), which the trainer's fp32 head would neither "
        "apply nor train; not supported",
    ),
}


def tiny_config(cls_name: str, values: dict):
    """A few-thousand-parameter config of the family: the Llama-like sizes where the class takes
    them, then `values`."""
    cls = getattr(transformers, cls_name)
    kwargs = {**LLAMA_LIKE, **values}
    if cls_name in ("GPT2Config", "GPTJConfig", "OPTConfig"):  # other names for the sizes
        kwargs = {k: v for k, v in kwargs.items() if k in ("vocab_size", "initializer_range")}
        kwargs.update(values)
        if cls_name == "OPTConfig":
            kwargs.update(hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
            kwargs.update(max_position_embeddings=64)
    return cls(**kwargs)


def save_model(path, cls_name: str, values: dict) -> str:
    """A random model of the family with the byte tokenizer, saved to `path`; returns `path`."""
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(tiny_config(cls_name, values))
    lm.save_pretrained(path)
    tiny.build_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A 1-rank gloo process group in this process: train.build shards with FSDP2."""
    store = torch.distributed.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def tokens(seed: int = 1):
    """Two rows of 12 random ids, the predicting positions and their targets (the next ids)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, 12), generator=g)  # (R, C)
    pred = torch.tensor([r * 12 + c for r in range(2) for c in range(11)])  # (N,)
    targets = ids[:, 1:].flatten()  # (N,)
    return ids, pred, targets


def own_logp(lm, ids, targets):
    """log_softmax of the model's own forward (transformers' causal-LM head, eval mode), at the
    predicting positions: (N,) float32."""
    lm.eval()
    with torch.no_grad():
        logits = lm(input_ids=ids, use_cache=False).logits[:, :-1].float()  # (R, C-1, V)
    logp = torch.log_softmax(logits.flatten(0, 1), dim=-1)  # (N, V)
    return logp.gather(1, targets[:, None])[:, 0]


def policy_logp(policy, ids, pred, targets):
    return policy(ids, None, None, pred, targets, temperature=1.0)


@pytest.mark.parametrize("family", list(EXACT))
def test_policy_log_probs_are_the_models_own(tmp_path, one_rank, family):
    cls_name, values = EXACT[family]
    path = save_model(tmp_path / family, cls_name, values)
    args = config.Args(model=path)
    lm = loading.load_model(args, path)
    assert lm.config.get_text_config().model_type == family
    ids, pred, targets = tokens()
    expected = own_logp(lm, ids, targets)
    assert expected.std() > 0.5  # logits of a few nats: a head factor of 3 or 4 would show
    policy, _ = train.build(lm, args, torch.device("cpu"))
    got = policy_logp(policy, ids, pred, targets)
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", list(REFUSED))
def test_a_head_the_trainer_cannot_compute_is_refused_in_one_line(tmp_path, family):
    cls_name, values, line = REFUSED[family]
    path = save_model(tmp_path / family, cls_name, values)
    with pytest.raises(config.BadInput) as info:
        loading.load_model(config.Args(model=path), path)
    assert str(info.value) == f"--model {path}: {line}" and info.value.code == 1


def test_a_soft_capped_model_is_refused_before_its_weights_load(tmp_path, monkeypatch):
    """The config alone refuses it: a large Gemma 2 never takes memory for weights it cannot
    train."""
    path = save_model(tmp_path / "gemma2", *REFUSED["gemma2"][:2])

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(config.BadInput) as info:
        loading.load_model(config.Args(model=path), path)
    assert str(info.value) == f"--model {path}: {REFUSED['gemma2'][2]}"


def test_train_py_refuses_gemma2_in_one_line_exit_1_no_run_dir(tmp_path):
    """Through train.py: the line, exit code 1, no traceback, no run directory."""
    path = save_model(tmp_path / "gemma2", *REFUSED["gemma2"][:2])
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "train.py", "--model", path, "--data", "arith", "--run-dir", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = f"train.py: --model {path}: {REFUSED['gemma2'][2]}"
    # besides transformers' weight-loading progress bar, which every run's start shows
    said = [s for s in out.stderr.splitlines() if s.strip() and not s.startswith("Loading weights")]
    assert out.returncode == 1 and said == [line], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert not run_dir.exists()


def test_decoder_layers_are_found_where_the_family_keeps_them(tmp_path):
    """GPT-2's blocks at transformer.h, OPT's at model.decoder.layers, Qwen3's at model.layers:
    each block once, in order, nothing inside one taken apart; a model naming no class it has is
    refused."""
    for family, where in LAYERS.items():
        lm = AutoModelForCausalLM.from_config(tiny_config(*EXACT[family]))
        layers = lm.get_submodule(where)
        assert loading.decoder_layers(lm) == list(layers) and len(layers) == 2
    lm._no_split_modules = ["NoSuchLayer"]
    with pytest.raises(ValueError, match=r"no decoder layers to shard: .*\(NoSuchLayer\)"):
        loading.decoder_layers(lm)


def counted(layer, forward, calls):
    def run(*args, **kwargs):
        calls.append(layer)
        return forward(*args, **kwargs)

    return run


@pytest.mark.parametrize("family", ["opt", "gpt2"])
def test_dropout_is_off_log_probs_repeat_bit_for_bit_and_checkpointing_recomputes(
    tmp_path, one_rank, family
):
    """OPT (dropout 0.1, attention_dropout 0.1 here) and GPT-2 (resid, embd, attn pdrop 0.1): two
    log-prob calls on the same tokens agree bit for bit; gradients reach every decoder layer; and
    with --activation-checkpointing each layer runs twice per forward + backward (transformers
    checkpoints only in train mode, which the policy keeps)."""
    cls_name, values = EXACT[family]
    path = save_model(tmp_path / family, cls_name, values)
    args = config.Args(model=path, activation_checkpointing=True)
    lm = loading.load_model(args, path)
    layers = lm.get_submodule(LAYERS[family])
    calls = []  # the layers whose forward ran, once per run
    for layer in layers:  # forward itself: torch 2.13's recompute in backward skips module hooks
        layer.forward = counted(layer, layer.forward, calls)
    policy, _ = train.build(lm, args, torch.device("cpu"))
    assert policy.training
    ids, pred, targets = tokens()
    first = policy_logp(policy, ids, pred, targets)
    second = policy_logp(policy, ids, pred, targets)
    assert torch.equal(first, second)
    calls.clear()
    policy_logp(policy, ids, pred, targets).sum().backward()
    assert [len([c for c in calls if c is layer]) for layer in layers] == [2, 2]
    for layer in layers:
        grads = [p.grad for p in layer.parameters() if p.requires_grad]
        assert grads and all(g is not None and g.full_tensor().abs().sum() > 0 for g in grads)
