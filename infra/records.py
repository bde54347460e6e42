"""A run's records, kept by rank 0: metrics.jsonl and samples.jsonl (and W&B), the held-out evals
queued on the eval engine (infra/evals.py) and logged as they finish, the eval history with its live
sigmoid fit (curve_fit, Eq. 1) and the final ones (final_fit: the first half, §5, and the whole
run), each on the evals from --fit-from on (A.5), and the checkpoints.

    python train.py --steps 2 --eval-every 2   # writes runs/NAME/{metrics,samples}.jsonl, fit.json
    python fit.py runs/NAME/metrics.jsonl        # the same fit, from the log, after the run

Each metrics.jsonl line carries the compute clock of the weights it measured: gpu_hours
(device-hours), tokens (generated + trained) and flops (2 N per generated token, 6 N per trained
token; N the parameters a token runs through: an MoE's active ones, placement.inactive_params).
An eval's line comes steps after the step it measured, in the order the evals were submitted,
with eval/logged_at_step. A checkpoint waits for no eval but the last step's: it names
those still running, and a resumed run keeps the line of one that finished after it (RunLog.save).

Where it departs from the paper (arXiv 2510.13786: pass rate §7.1 and A.5, the fit §5), and why:
1. Evals are asynchronous (infra/evals.py): an eval's line is logged late, against the step and
   compute clock of the weights it measured, not those of the step that logged it.
2. gpu_hours counts the distinct devices of trainer and generators (the paper: GB200-hours); on
   CPU the machine counts as one device.
"""

import collections
import dataclasses
import functools
import json
import os
import re
import time

import numpy as np
import torch.distributed as dist

import fit
import pipeline
from config import FIT_FROM_FRACTION, Args
from infra import (
    checkpoint,
    fit_report,  # the whole-run fit and the plot live with fit.py's command line
)
from infra.launch import HEARTBEAT_S, rank0_call
from tasks import data


def fit_start(fit_from: float | None, c_end: float) -> float:
    """The compute (gpu_hours) from which the fits take evals: --fit-from, or with None the first
    FIT_FROM_FRACTION of the run's compute c_end (gpu_hours; config.py departure 7: the paper's
    first epoch, A.5)."""
    return FIT_FROM_FRACTION * c_end if fit_from is None else float(fit_from)


def curve_fit(history: list[dict], steps: int, fit_from: float | None = 0.0) -> dict:
    """Fit Eq. 1 to the held-out curve so far (pass rate vs gpu_hours; R0 = the step-0 eval) on the
    evals from fit_start(fit_from, the run's projected compute) on, and predict the pass rate at the
    last step, extrapolating compute linearly in steps. history: the evals finished so far, in
    compute order. {} until R0 and 4 evals to fit have finished; fit/from, fit/n: where the fit
    starts (gpu_hours) and the evals it fitted."""
    if not history or history[0]["step"] != 0:
        return {}
    c_end = history[-1]["gpu_hours"] * steps / max(history[-1]["step"], 1)
    start = fit_start(fit_from, c_end)
    pts = [
        (h["gpu_hours"], h["eval/pass_rate"])
        for h in history
        if h["step"] > 0 and h["gpu_hours"] >= start
    ]
    if len(pts) < 4:
        return {}
    C, R = map(np.array, zip(*pts, strict=True))
    where = {"fit/from": start, "fit/n": float(len(pts))}
    try:
        f = fit.fit_sigmoid(C, R, history[0]["eval/pass_rate"])
    except (ValueError, RuntimeError) as e:
        return {**where, "fit/converged": 0.0, "fit/error": str(e)}
    return {  # converged = 0 also when A is not identified (fit.py's rule); A_lo, A_hi: its profile
        **where,
        "fit/A": f.A,
        "fit/A_lo": f.A_interval[0],
        "fit/A_hi": f.A_interval[1],
        "fit/B": f.B,
        "fit/C_mid": f.C_mid,
        "fit/converged": float(f.converged),
        "fit/pred_final": float(f.predict(c_end)),
    }


def final_fit(run_dir: str, history: list[dict], fit_from: float | None = 0.0) -> dict:
    """The paper's protocol (§5) on this run: fit on the first half of its compute, predict the
    second half (mean absolute error on the held-out evals); plot it like Figure 1 (fit.png) and
    save the numbers (fit.json). Beside it, "whole_run": the fit on all the evals
    (fit_report.whole_run_fit). Both fit the evals from fit_start(fit_from, the run's compute) on
    (A.5: the early transient left out); "evals" in fit.json names them by step: fit_from (the
    start, gpu_hours), left_out (before it), whole_run, first_half (fitted) and held_out (the
    second half, predicted).
    A run of several tasks (history with eval/<task>/pass_rate) also gets those fits per task,
    under "tasks" in fit.json (the paper's math curve and code curve), and fit.png draws those
    curves instead of the overall one. A fit that fails holds its "error" and is not drawn.
    fit_report.summary says it in words."""
    if not history or history[0]["step"] != 0:  # R0 was abandoned (Ctrl-C) and could not run again
        out = {"error": "no step-0 eval (R0): nothing to fit against"}
        with open(os.path.join(run_dir, "fit.json"), "w") as f:
            json.dump(out, f, indent=1)
        return out
    C = np.array([h["gpu_hours"] for h in history[1:]])
    steps = np.array([h["step"] for h in history[1:]], dtype=np.int64)
    half = C[-1] / 2 if len(C) else 0.0
    start = fit_start(fit_from, C[-1] if len(C) else 0.0)
    fitted = C >= start
    evals = {
        "fit_from": start,
        "left_out": steps[~fitted].tolist(),
        "whole_run": steps[fitted].tolist(),
        "first_half": steps[fitted & (C <= half)].tolist(),
        "held_out": steps[C > half].tolist(),
    }
    tasks = [m[1] for k in history[0] if (m := re.fullmatch(r"eval/(.+)/pass_rate", k))]
    curves = []  # (name, C, R, fit) for fit_report.plot

    def one(name: str, key: str) -> dict:
        R = np.array([h[key] for h in history[1:]])
        R0 = history[0][key]
        out = {"R0": R0, "final_pass_rate": float(R[-1]) if len(R) else R0, "fit_until": half}
        out["whole_run"] = fit_report.whole_run_fit(C, R, R0, fit_from=start)
        try:
            f, mae, n_tail = fit.extrapolate(C, R, R0, fit_until=half, fit_from=start)
        except (ValueError, RuntimeError) as e:
            return {**out, "error": str(e)}
        curves.append((name, C, R, f))
        out.update(
            A=f.A,
            A_interval=f.A_interval,
            B=f.B,
            C_mid=f.C_mid,
            converged=f.converged,
            message=f.message,
            tail_mae=mae,
            n_tail=n_tail,
            predicted_final=float(f.predict(C[-1:])[0]),
        )
        return out

    out = one(os.path.basename(run_dir), "eval/pass_rate")
    out["evals"] = evals
    if tasks:
        curves.clear()  # one curve per task on the plot
        out["tasks"] = {t: one(t, f"eval/{t}/pass_rate") for t in tasks}
    if curves:
        ylabel = "eval/<task>/pass_rate" if tasks else "eval/pass_rate"
        path = os.path.join(run_dir, "fit.png")
        fit_report.plot(
            curves, path, xlabel="gpu_hours", ylabel=ylabel, fit_from=start, fit_until=half
        )
    with open(os.path.join(run_dir, "fit.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def clock_fields(c: dict) -> dict:
    """The compute clock `c` as a metrics.jsonl line carries it (x-axes for the fit and plots)."""
    return {
        "gpu_hours": c["gpu_hours"],
        "tokens": c["gen_tokens"] + c["train_tokens"],
        "flops": c["flops"],
        "clock/gen_tokens": c["gen_tokens"],
        "clock/train_tokens": c["train_tokens"],
    }


def eval_line(at: int, steps: int, m: dict, r, step: int) -> str:
    """The console line of the eval of step `at` (result r, metrics m), logged at loop step `step`:
    the pass rate (each task's beside it in a run of several), greedy (where sampled), the live
    fit."""
    fitted = f" | fit A {m['fit/A']:.3f} -> {m['fit/pred_final']:.3f}" if "fit/A" in m else ""
    greedy = m.get("eval/greedy_pass_rate")
    greedy = "" if greedy is None else f" | greedy {greedy:.3f}"
    per_task = [(t[1], v) for k, v in m.items() if (t := re.fullmatch(r"eval/(.+)/pass_rate", k))]
    tasks = f" ({', '.join(f'{t} {v:.3f}' for t, v in per_task)})" if per_task else ""
    return (
        f"eval {at:5d}/{steps} | pass {m['eval/pass_rate']:.3f}{tasks}{greedy}{fitted} | "
        f"version {r.version} | {r.eval_s:.1f} s "
        f"after {r.queued_s:.1f} s queued, logged at step {step}"
    )


class RunLog:
    """The run's records. Every rank holds one; only rank 0 writes (`master`), and await_evals and
    save are collectives. `history` (the finished evals, in compute order) and `clock` (the compute
    clock: gpu_hours, gen_tokens, train_tokens, flops) are the run's state, restored on --resume;
    the step loop and the waits for evals advance the clock in place. `saved`: the step of the
    newest checkpoint (None before the first)."""

    def __init__(self, args: Args, run_dir: str, eval_engine, eval_prompts, state: dict, inputs):
        self.args = args
        self.run_dir = run_dir
        self.eval_engine = eval_engine  # rank 0's evals.EvalEngine (None on the other ranks)
        self.eval_prompts = eval_prompts
        self.history = state["history"]
        self.clock = state["clock"]
        self.saved = state["step"] if args.resume else None
        self.thinking = inputs.thinking  # (loading.Inputs) the eval checks the thinking format
        # distinct GPUs (trainer + generator, shared ones once); 1 on CPU
        self.devices = inputs.plan.devices
        self.master = dist.get_rank() == 0
        self.first_eval = True  # the thinking format is checked once, on the first finished eval
        self.wandb = None
        self.metrics_f = None
        self.samples_f = None
        if not self.master:
            return
        if args.wandb_project:
            import wandb

            wandb.init(
                project=args.wandb_project,
                name=os.path.basename(run_dir),
                config=dataclasses.asdict(args),
                resume="allow",
            )
            # an eval's line comes steps after the step it measured: its charts run on eval/step
            wandb.define_metric("eval/step")
            for prefix in ("eval/*", "fit/*"):
                wandb.define_metric(prefix, step_metric="eval/step")
            self.wandb = wandb
        self.metrics_f = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self.samples_f = open(os.path.join(run_dir, "samples.jsonl"), "a")

    def close(self) -> None:
        for f in (self.metrics_f, self.samples_f):
            if f is not None:
                f.close()

    def is_eval_step(self, step: int) -> bool:
        """Every eval_every steps and the last (step 0, R0, is evaluated before the first step)."""
        return step % self.args.eval_every == 0 or step == self.args.steps

    def write(self, line: dict, step: int) -> None:
        """Rank 0: one metrics.jsonl line, and W&B at the loop's `step`."""
        # samples first: an eval's line on disk means its samples are whole (checkpoint.resume_logs)
        self.samples_f.flush()
        self.metrics_f.write(json.dumps(line) + "\n")
        self.metrics_f.flush()
        if self.wandb is not None:  # eval lines come late: their charts run on eval/step
            if "eval/version" in line:
                line = {**line, "eval/step": line["step"]}
            self.wandb.log(line, step=step)

    def train_samples(self, step: int, groups) -> None:
        """Rank 0: the first rollout of the first log_samples groups, in samples.jsonl."""
        for g in groups[: self.args.log_samples]:
            sample = {
                "step": step,
                "split": "train",
                "prompt": g.prompt.index,
                "text": g.completions[0].text,
                "gold": g.prompt.gold,
                "reward": g.rewards[0],
                "reason": g.reasons[0] if g.reasons else None,
            }
            self.samples_f.write(json.dumps(sample) + "\n")

    def end_step(
        self, step: int, m: dict, seconds: float, n_params: int, tag: dict, active: int
    ) -> None:
        """Rank 0, after each step: the compute clock advanced by the step (`seconds` on every
        device: the eval engine's count, it runs meanwhile; 2 N flops per generated token, 6 N per
        trained one, N = `n_params`, the parameters per token: an MoE's active ones), the eval's
        `tag` stamped with it, the step's metrics.jsonl and console line,
        and the evals finished meanwhile with their live fit. `active`: the prompt pool's."""
        if not self.master:
            return
        c = self.clock
        c["gpu_hours"] += seconds * self.devices / 3600
        c["gen_tokens"] += m["gen/tokens"]
        c["train_tokens"] += m["train/tokens"]
        c["flops"] += 2 * n_params * m["gen/tokens"] + 6 * n_params * m["train/tokens"]
        m["time/step_s"] = seconds
        m["eval/pending"] = len(self.eval_engine.pending())
        tag["clock"] = dict(c)
        self.write({"step": step, **clock_fields(c), **m}, step)
        reward = f"{m['train/reward']:.3f}" if "train/reward" in m else "-"
        print(
            f"step {step:5d}/{self.args.steps} | reward {reward} | "
            f"lag {m.get('train/lag_max', 0):.0f} | "
            f"zero-var {m.get('filter/zero_var_frac', 0):.2f} | active {active} | "
            f"clip {m.get('train/clip_frac', 0):.3f} | {m.get('time/step_s', 0):.1f} s",
            flush=True,
        )
        self.log_evals(step)

    def submit_eval(self, weights: str | None, tag: dict, last: bool = False) -> None:
        """Rank 0: queue the eval of the weights in `weights` (trainer version tag["step"]) on the
        eval engine (evals.EvalEngine); tag["clock"], the compute clock of that version, may be
        filled in later (before log_evals runs). The paper's metric: eval_n samples per held-out
        prompt at the training temperature; one greedy sample beside it, logged, never fitted, at
        R0, the run's last step (or `last`: a run that ended early) and every
        --eval-greedy-every-th eval."""
        step = tag["step"]
        every = self.args.eval_greedy_every * self.args.eval_every
        greedy = last or step in (0, self.args.steps) or (every > 0 and step % every == 0)
        try:
            self.eval_engine.submit(
                self.eval_prompts,
                self.args.eval_n,
                version=step,
                weights=weights,
                greedy=greedy,
                tag=tag,
            )
        except pipeline.Stopped:  # Ctrl-C meanwhile: abandoned with the others (save)
            pass

    def snapshot(self, tag: dict):
        """For weight_pusher's `snapshot` at an eval step (every rank): submit_eval on rank 0, a
        no-op elsewhere."""
        if self.master:
            return functools.partial(self.submit_eval, tag=tag)
        return lambda weights: None

    def submit_start_evals(self, step: int, path: str, start_dir: str | None) -> None:
        """Rank 0, before the first step: R0, the curve's anchor (Eq. 1's pass rate at the start),
        from the start weights `path`; on --resume also the checkpoint's own eval (from
        `start_dir`) and R0 again if they had not finished (abandoned by a Ctrl-C, or still running
        at a kill: train.restore)."""
        if not self.master:
            return
        done = {h["step"] for h in self.history}
        zero = {"gpu_hours": 0.0, "gen_tokens": 0, "train_tokens": 0, "flops": 0.0}
        if 0 not in done and (step == 0 or os.path.isdir(path)):
            self.submit_eval(path, {"step": 0, "clock": zero})
        elif 0 not in done:
            print(f"warning: no step-0 eval (R0) and {path} is not a directory to rerun it from")
        if step > 0 and self.is_eval_step(step) and step not in done:
            self.submit_eval(start_dir, {"step": step, "clock": dict(self.clock)})

    def submit_last_eval(self, step: int, path: str) -> None:
        """Rank 0: the eval of a run's last weights, exported to `path`, when the run ended before
        --steps (every training prompt retired) at a step that is no eval step and whose eval is
        not in the history (a resumed run's may be)."""
        if not self.master or self.is_eval_step(step):
            return
        if step not in {h["step"] for h in self.history}:
            self.submit_eval(path, {"step": step, "clock": dict(self.clock)}, last=True)

    def log_evals(self, step: int) -> None:
        """Rank 0: every eval finished since the last call gets its metrics.jsonl line against the
        step, weight version and compute clock it measured (logged later, in the order submitted),
        its samples, its place in the history (compute order) and the live fit (fit/*)."""
        for r in self.eval_engine.results():
            at, c = r.tag["step"], r.tag["clock"]
            if self.thinking and self.first_eval:
                warning = data.thinking_warning(r.records)
                if warning:
                    print(warning, flush=True)
            self.first_eval = False
            shown = collections.Counter()  # the first log_samples records of each task
            for rec in r.records:
                shown[rec["task"]] += 1
                if shown[rec["task"]] <= self.args.log_samples:
                    self.samples_f.write(json.dumps({"step": at, "split": "eval", **rec}) + "\n")
            m = {
                **r.metrics,
                "eval/logged_at_step": step,
                "time/eval_s": r.eval_s,
                "time/eval_queued_s": r.queued_s,
            }
            line = {"step": at, **clock_fields(c), **m}
            # its point from its line, as a resumed run rebuilds it (checkpoint.resume_logs)
            checkpoint.add_eval(self.history, line)
            m.update(curve_fit(self.history, self.args.steps, self.args.fit_from))
            line.update(m)
            self.write(line, step)
            print(eval_line(at, self.args.steps, m, r, step), flush=True)

    def await_evals(self, step: int, done, why: str, count: bool = True) -> bool:
        """Every rank (a collective): rank 0 waits until done(versions of the evals pending) holds,
        logging each eval as it finishes, while the other ranks poll (rank0_call); with `count`, the
        wait goes on the compute clock (the devices are held meanwhile; inside a step it is in the
        step's time already). False if a stop (Ctrl-C) cut it short."""

        def wait() -> bool:
            t0 = time.perf_counter()
            try:
                while not done(self.eval_engine.pending()):
                    at_most = len(self.eval_engine.pending()) - 1
                    self.eval_engine.wait(at_most, timeout=HEARTBEAT_S)
                    self.log_evals(step)
            except pipeline.Stopped:
                self.log_evals(step)  # those that finished before the stop are kept
                return False
            finally:
                waited = time.perf_counter() - t0
                self.clock["gpu_hours"] += waited * self.devices / 3600 if count else 0.0
                if waited > HEARTBEAT_S:
                    print(f"waited {waited:.1f} s for {why}", flush=True)
            self.log_evals(step)
            return True

        return rank0_call(wait, share=True)

    def await_eval_room(self, step: int) -> bool:
        """Every rank, at an eval step: wait until fewer than max_evals_pending evals are running
        (they are slower than --eval-every steps otherwise), off the compute clock: the step's time
        holds the wait. False if a stop (Ctrl-C) cut it short: then no eval this step."""
        return self.await_evals(
            step,
            lambda pending: len(pending) < self.eval_engine.max_evals_pending,
            "room in the eval queue (evals are slower than --eval-every steps)",
            count=False,
        )

    def save(self, step: int, policy, optimizer, pool, stopping: bool = False) -> None:
        """A checkpoint of this step (a collective: every rank writes its shards). It waits for no
        eval (an eval of 1,000 prompts x 16 runs for hours, a step for minutes: issue 25), except at
        the last step, whose evals the run's end and final fit need. The run state names the evals
        still pending (`pending_evals`, rank 0's: steps <= this one); one that finishes after the
        checkpoint is logged as ever, and on --resume its line stays and joins the history
        (checkpoint.resume_logs), while one that never finished is lost, bar R0 and this step's
        own, which run again from their weights (submit_start_evals). On a stop (Ctrl-C) pending
        evals are abandoned (nothing logs after this checkpoint) and said so."""
        if self.saved == step:
            return
        finished = True
        if step == self.args.steps and not stopping:
            finished = self.await_evals(step, lambda pending: not pending, "the last evals")
        pending = []
        if self.master:
            # pending before results: an eval finishing in between is then in one of the two
            pending = self.eval_engine.pending()
            self.log_evals(step)  # evals finished since the last step's log go in the history
            done = {h["step"] for h in self.history}
            pending = [v for v in pending if v not in done]
        if pending and (stopping or not finished):
            again = f"; step {step}'s runs again on --resume" if step in pending else ""
            print(
                f"warning: the eval(s) of step(s) {pending} were still running: abandoned{again}",
                flush=True,
            )
        run_state = {
            "version": step,
            "clock": self.clock,
            "history": self.history,
            "pool": pool.state_dict() if self.master else None,
            "pending_evals": pending if self.master else None,
        }
        checkpoint.save_checkpoint(self.run_dir, step, policy, optimizer, run_state)
        self.saved = step
