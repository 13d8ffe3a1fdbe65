"""grpolab vs TRL on a real model: each trainer in its own process, rounds interleaved.

    python bench/vs_trl_real.py [--model smollm2-135m-instruct] [--rounds 2 --steps 2 --warmup 1]
                                [--batch 32 --group-size 8 --max-new-tokens 64 --threads 2]

Runs TRL's ``GRPOTrainer`` and grpolab's ``GRPOTrainer`` (``HFBackend``) on the same local HF
model folder (``--model`` is a folder or a name grpolab resolves, e.g. smollm2-135m-instruct:
the converted float32 folder under ~/.cache/grpolab/models is handed to both) with identical
settings:

* chat-templated prompts (the tokenizer's template, a user turn, generation prompt added) over a
  local set of generated two-digit additions, and one exact-answer reward for both;
* B completions per optimizer step (B / G prompts x G answers), one generation per step, one
  optimisation pass, no gradient accumulation, at most L new tokens, temperature 1, no
  top-k/top-p, beta (KL to the reference), Adam(W) at a constant lr, no weight decay, gradient
  clipping at 1, float32 (``--dtype bfloat16``: both in bfloat16, TRL with ``bf16=True``,
  grpolab with ``dtype: bfloat16``; the LoRA adapters stay float32 in both; on CUDA grpolab
  samples with them folded into float32 copies of q/k/v/o, which run in float32), no gradient
  checkpointing;
* LoRA r=8, alpha 16, dropout 0 on q_proj, k_proj, v_proj, o_proj for both (peft); the reference
  is the model with the adapters off in both (no copy);
* per-reply mean loss (TRL ``loss_type='grpo'`` == grpolab ``seq_mean_token_mean``), group std
  scaling with the sample std + 1e-4.

Each (round, trainer) is a fresh subprocess, so ``ru_maxrss`` in the child is that trainer's
peak resident memory (model load, imports and all). The order alternates round by round (TRL
first, then grpolab first, ...) so machine noise reaches both. The first ``--warmup`` steps of a
child are not timed; model loading and trainer construction are not timed.

Time split per timed step (wall clock, seconds):

* gen: TRL ``_generate`` (tokenize, ``model.generate``, decode) / grpolab ``backend.generate``;
* ref: log-probs of the reference (adapters off, no grad): TRL ``_get_per_token_logps_and_
  entropies`` outside autograd / grpolab ``backend.logprobs(..., reference=True)``;
* pol: policy forward + backward: TRL ``training_step`` less its ``_prepare_inputs`` (which
  generates, scores rewards and the reference) / grpolab ``update`` less its reference pass
  (this includes the LoRA optimizer step, which is tiny);
* other: the rest of the step (rewards, advantages, optimizer step for TRL, bookkeeping).

Completions stop at EOS, so the two trainers can generate different amounts; tokens generated
per step and generated tokens per second are printed next to steps/s.

With ``--flops`` (default on) the children of the last round run one more step under
``torch.utils.flop_counter.FlopCounterMode`` after their timed steps and after reading their
peak memory; the parent measures the machine's matmul rate (in ``--dtype``) at the same thread
count.
Counted work / rate is the floor for that trainer's step on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}

# ----------------------------------------------------------------------------- task


def make_rows(n: int, seed: int) -> list[dict[str, str]]:
    """Two-digit additions with their answers, generated here (no dataset download)."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"question": f"What is {a} + {b}? Reply with the number only.",
                     "answer": str(a + b)})
    return rows


def _text(c: Any) -> str:
    """A completion as text: a string (grpolab, plain prompts) or chat messages (TRL)."""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c and isinstance(c[-1], dict):
        return str(c[-1].get("content", ""))
    return str(c)


def exact_answer_reward(prompts: list[Any], completions: list[Any], answer: list[str],
                        **_: Any) -> list[float]:
    """1 when the last integer in the completion is the answer, else 0 (both trainers)."""
    out = []
    for c, a in zip(completions, answer):
        nums = re.findall(r"-?\d+", _text(c).replace(",", ""))
        out.append(1.0 if nums and nums[-1] == a else 0.0)
    return out


# ----------------------------------------------------------------------------- timing


class Split:
    """Wall-clock time per phase, accumulated until ``close_step`` files it under one step."""

    sync: Any = None  # on a GPU: torch.cuda.synchronize, so each phase owns its kernels

    def __init__(self) -> None:
        self.cur: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self.begin: list[tuple[float, float]] = []  # (wall, cpu) at each step's start
        self.notes: dict[str, str] = {}  # what the report must say beside the times

    def add(self, key: str, dt: float) -> None:
        self.cur[key] = self.cur.get(key, 0.0) + dt

    def wrap(self, obj: Any, name: str, key: str, when: Any = None) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            if when is not None and not when(*a, **kw):
                return fn(*a, **kw)
            if self.sync:
                self.sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if self.sync:
                    self.sync()
                self.add(key, time.perf_counter() - t0)

        setattr(obj, name, timed)

    def close_step(self, **extra: float) -> None:
        self.steps.append({**self.cur, **extra})
        self.cur = {}


# ----------------------------------------------------------------------------- children


def child_trl(args: argparse.Namespace, model_dir: str, out: str, split: Split) -> Any:
    """Build TRL's trainer; returns a function that runs all steps and one to count FLOPs."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
            for r in make_rows(512, args.seed)]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.trainer: Any = None

        def on_step_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            split.begin.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            if split.sync:  # the optimizer's kernels belong to this step
                split.sync()
            m = self.trainer._metrics["train"]
            split.close_step(end=time.perf_counter(), cpu=time.process_time(),
                             tokens=m["completions/mean_length"][-1] * args.batch,
                             width=m["completions/max_length"][-1])

    cfg = GRPOConfig(
        output_dir=out, num_generations=args.group_size,
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_k=0, top_p=1.0, beta=args.beta, epsilon=0.2,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, loss_type="grpo", scale_rewards="group", disable_dropout=True,
        gradient_checkpointing=False, bf16=args.dtype == "bfloat16", fp16=False,
        use_cpu=args.device == "cpu",
        report_to="none",
        logging_steps=10**6, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        max_steps=args.warmup + args.steps, seed=args.seed,
        model_init_kwargs={"dtype": getattr(torch, args.dtype)},
        # --fixed-length: no EOS before max_new_tokens, so both trainers do the same work
        generation_kwargs=({"min_new_tokens": args.max_new_tokens} if args.fixed_length else {}),
    )
    peft_cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
                          task_type="CAUSAL_LM")
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tok.padding_side = "left"
    clock = Clock()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[exact_answer_reward], args=cfg,
                          train_dataset=Dataset.from_list(rows), processing_class=tok,
                          callbacks=[clock], peft_config=peft_cfg)
    clock.trainer = trainer
    split.wrap(trainer, "_generate", "gen")
    split.wrap(trainer, "_get_per_token_logps_and_entropies", "ref",
               when=lambda *a, **k: not torch.is_grad_enabled())
    split.wrap(trainer, "_prepare_inputs", "prep")
    split.wrap(trainer, "training_step", "train_step")
    n_train = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)

    def run() -> None:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train()

    def one_step() -> None:
        trainer.args.max_steps = 1
        run()

    return run, one_step, n_train


LAB_VARIANTS = {  # --levers: grpolab with one lever changed (in its own process)
    "full": "as shipped",
    "no-pack": "cpu_pack off: sampling through peft's LoRA layers and MKL matmuls, the "
               "scoring head on F.linear",
    "no-score-pack": "the scoring passes' frozen linears on MKL (F.linear) instead of "
                     "oneDNN copies (forward and input gradient)",
    "no-chunk": "logit_chunk 0: the [tokens, vocab] logits held whole when scoring",
    "no-eager-head": "the chunked head's backward recomputes each chunk's logits (instead of "
                     "forward finishing the hidden states' gradient under a frozen head)",
    "no-early-exit": "finished answers stay in the decode batch until every answer has ended "
                     "(as HF generate)",
    "no-buckets": "answers scored in one forward padded to the longest (instead of only their "
                  "real positions, in length buckets)",
    "no-share": "no shared prompts: each of a group's G rows prefills and scores its prompt",
    "hf-forward": "speed lean_forward off: the HF forward for sampling and scoring",
    "threads1": "1 torch thread instead of --threads",
    "micro8": "micro_batch 8: the update in 8-row forward/backward passes",
    "micro4": "micro_batch 4",
    "micro64": "micro_batch 64",
    "no-graph": "speed graph_decode off (CUDA): the plain decode loop, each kernel launched "
                "from Python, instead of one replayed CUDA graph per token",
    "ckpt": "gradient checkpointing: each layer recomputed in backward",
    "bf16": "dtype bfloat16: the frozen weights and matmuls in bfloat16 (LoRA adapters, "
            "optimizer and log-softmax in float32)",
}


def lab_dtype(args: argparse.Namespace) -> str:
    return "bfloat16" if args.variant == "bf16" else args.dtype


def child_lab(args: argparse.Namespace, model_dir: str, out: str, split: Split) -> Any:
    from grpolab.app.commands import make_backend
    from grpolab.config import Config, Speed, resolve
    from grpolab.rollout.models import load_model
    from grpolab.run.trainer import GRPOTrainer

    rows = [{"prompt": r["question"], "answer": r["answer"]} for r in make_rows(512, args.seed)]
    cfg = resolve(Config(
        out_dir=out, seed=args.seed, steps=10**6, budget=args.batch, group_size=args.group_size,
        temperature=1.0, max_new_tokens=args.max_new_tokens, lr=args.lr, grad_clip=1.0,
        epochs=1, beta=args.beta, eps_low=0.2, eps_high=0.2, loss_agg="seq_mean_token_mean",
        baseline="mean", scale="std", std="sample", std_eps=1e-4, eval_every=10**6,
        checkpoint_every=0, progress=False, model_path=model_dir, use_chat_template=True,
        lora=True, lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_target_modules=TARGETS,
        dtype=lab_dtype(args), logit_chunk=0 if args.variant == "no-chunk" else Config.logit_chunk,
        speed=Speed(**{SPEED_LEVERS[args.variant]: False} if args.variant in SPEED_LEVERS else {}),
        micro_batch={"micro8": 8, "micro4": 4, "micro64": 64}.get(args.variant, 0),
        gradient_checkpointing=args.variant == "ckpt",
    ))
    if args.variant == "no-share":
        import grpolab.rollout.graphdecode as gd
        import grpolab.rollout.hf as hb

        hb.shared_prompts = gd.shared_prompts = lambda ids, mask: None  # one prefill per row
        hb.HFBackend.share_prompts = property(lambda self: False)  # scoring: one pass per row
    model, tok = load_model(model_dir, device=args.device, dtype=lab_dtype(args))
    backend = make_backend(cfg, model, tok)
    if args.variant in AB_SWITCHES:
        AB_SWITCHES[args.variant](backend, False)
    if args.fixed_length:  # no token is EOS: every answer runs to max_new_tokens
        backend.eos_ids = [-1]
    trainer = GRPOTrainer(cfg, backend, rows, [exact_answer_reward], heldout_rows=[],
                          out_dir=out)
    tokens: list[tuple[int, int]] = []
    gen = backend.generate

    def counted(prompts: Any, temperature: float, max_new_tokens: int, generator: Any = None
                ) -> Any:
        built = backend._graphs.builds
        ro = gen(prompts, temperature, max_new_tokens, generator)
        split.add("graph_builds", backend._graphs.builds - built)  # CUDA: captures this call
        if backend._graphs.capture_failed:  # decoded uncaptured: slower, and said so
            split.notes["graph_failed"] = backend._graphs.capture_failed
        tokens.append((int(ro.completion_mask.sum()), int(ro.completion_ids.shape[1]),
                       int(ro.prompt_ids.shape[1])))
        split.add("tokens", tokens[-1][0])
        return ro

    backend.generate = counted
    split.wrap(backend, "generate", "gen")
    split.wrap(backend, "logprobs", "ref", when=lambda *a, **k: bool(k.get("reference")))
    for part in ("score", "advantages", "optimize"):  # the update, as step() calls it
        split.wrap(trainer, part, "update")
    n_train = sum(p.numel() for p in backend.model.parameters() if p.requires_grad)

    def run() -> None:
        for _ in range(args.warmup + args.steps):
            split.begin.append((time.perf_counter(), time.process_time()))
            trainer.step()
            tok_n, width, prompt = tokens[-1]
            split.close_step(end=time.perf_counter(), cpu=time.process_time(), tokens=tok_n,
                             width=width, prompt=prompt)

    return run, trainer.step, n_train


def phases(who: str, s: dict[str, float]) -> dict[str, float]:
    """One step's time split (gen, ref, pol; see the module docstring) from its ``Split``."""
    pol = (s.get("train_step", 0.0) - s.get("prep", 0.0) if who == "trl"
           else s.get("update", 0.0) - s.get("ref", 0.0))
    return {"gen": s.get("gen", 0.0), "ref": s.get("ref", 0.0), "pol": pol}


def child_main(args: argparse.Namespace) -> int:
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    import logging
    import warnings

    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("transformers", "trl", "accelerate", "grpolab", "peft", "httpx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    split = Split()
    cuda = args.device == "cuda"
    if cuda:
        split.sync = torch.cuda.synchronize
    t_load = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"vs-trl-real-{args.child}-") as out:
        build = child_trl if args.child == "trl" else child_lab
        run, one_step, n_train = build(args, args.model, out, split)
        rss_built = (torch.cuda.max_memory_allocated() / 2**20 if cuda
                     else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        t_built = time.perf_counter()
        split.cur = {}
        run()
        # peak memory: the GPU's allocated peak on cuda (what limits a GPU run), else RSS
        peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # MiB
        steps = split.steps
        w = args.warmup
        # From the previous step's end (warm-up), or from the first step's start (--warmup 0:
        # TRL's train() setup before its first step is then not counted).
        t0, c0 = (split.begin[0] if w == 0 else (steps[w - 1]["end"], steps[w - 1]["cpu"]))
        timed = steps[w:]
        res: dict[str, Any] = {
            "trainer": args.child, "round": args.round, "steps": len(timed),
            "time": timed[-1]["end"] - t0, "cpu": timed[-1]["cpu"] - c0,
            "tokens": sum(s["tokens"] for s in timed), "width": statistics.mean(
                s["width"] for s in timed),
            "peak_rss_mib": peak, "rss_after_build_mib": rss_built,
            "build_s": t_built - t_load, "trainable": n_train, "threads": torch.get_num_threads(),
            "device": args.device,
            # the allocator's own peak: allocated + cached, CUDA graphs' private pools included
            "reserved_mib": torch.cuda.max_memory_reserved() / 2**20 if cuda else None,
            "prompt_len": statistics.mean(s.get("prompt", 0) for s in timed),
            "graph_builds": sum(s.get("graph_builds", 0) for s in timed),
            "graph_failed": split.notes.get("graph_failed"),
        }
        res["split"] = {k: sum(phases(args.child, s)[k] for s in timed)
                        for k in ("gen", "ref", "pol")}
        print("RESULT " + json.dumps(res), flush=True)  # kept if the count below is cut
        if cuda and args.memory_trace:
            from gpu_memory import trace_step

            try:
                print("MEMORY " + json.dumps(trace_step(one_step)), flush=True)
            except (RuntimeError, KeyError, AttributeError, TypeError) as e:  # result stands
                print(f"MEMORY-ERROR {type(e).__name__}: {e}", flush=True)
        if args.flops:
            from vs_trl import count_flops

            if cuda and args.child == "lab":  # a replayed graph's work is not seen by the
                be = one_step.__self__.backend  # counter: count on the plain loop (same work)
                be.speed = dataclasses.replace(be.speed, graph_decode=False)
            print(f"FLOPS {count_flops(one_step)}", flush=True)
    return 0


# ----------------------------------------------------------------------------- parent


def matmul_rate(threads: int, tokens: int, hidden: int, inter: int, vocab: int,
                dtype: str = "float32") -> float:
    """FLOP/s of the fastest of a few matmuls in ``dtype`` (the model's shapes and a square
    one)."""
    import torch

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    best = 0.0
    for m, k, n in [(tokens, hidden, vocab), (tokens, hidden, inter), (1024, 1024, 1024)]:
        a, w = torch.randn(m, k, dtype=dt), torch.randn(n, k, dtype=dt)
        torch.nn.functional.linear(a, w)
        reps = 3
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(a, w)
        best = max(best, 2 * m * k * n * reps / (time.perf_counter() - t0))
    return best


def gpu_rates(dtype: str, tokens: int, hidden: int, inter: int, vocab: int
              ) -> tuple[float, float]:
    """(FLOP/s of the fastest of a few matmuls in ``dtype``, bytes/s of a device-to-device
    copy of 1 GiB) on the current CUDA device, each the best of a few timed runs."""
    import torch

    dt = getattr(torch, dtype)

    def best(fn: Any, work: float) -> float:
        fn()
        torch.cuda.synchronize()
        out = 0.0
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out = max(out, work / (time.perf_counter() - t0))
        return out

    rate = 0.0
    for m, k, n in [(tokens, hidden, vocab), (tokens, hidden, inter), (8192, 8192, 8192)]:
        a = torch.randn(m, k, dtype=dt, device="cuda")
        w = torch.randn(n, k, dtype=dt, device="cuda")
        rate = max(rate, best(lambda a=a, w=w: torch.nn.functional.linear(a, w), 2 * m * k * n))
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bw = best(lambda: dst.copy_(src), 2 * src.numel())  # each byte read once, written once
    return rate, bw


def decode_bytes(cfg: dict[str, Any], dtype: str, rows: int, prompt: int, new: int) -> float:
    """Bytes a decode must read for one batch: every weight once per token step, and at step t
    each row's keys and values so far (prompt + t positions, every layer)."""
    size = 2 if dtype in ("bfloat16", "float16") else 4
    h, layers, inter, vocab = (cfg["hidden_size"], cfg["num_hidden_layers"],
                               cfg["intermediate_size"], cfg["vocab_size"])
    heads = cfg["num_attention_heads"]
    dim = cfg.get("head_dim") or h // heads
    q, kv = heads * dim, cfg.get("num_key_value_heads", heads) * dim
    weights = (layers * (2 * h * q + 2 * h * kv + 3 * h * inter) + vocab * h) * size
    kv_bytes = sum(rows * layers * 2 * kv * (prompt + t) * size for t in range(new))
    return new * weights + kv_bytes


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return float("nan")


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def one(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"no {name}"

    return ", ".join(one(n) for n in ("torch", "transformers", "peft", "trl"))


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_child(args: argparse.Namespace, who: str, rnd: int, flops: bool,
              deadline: float, variant: str = "full", max_new: int = 0
              ) -> dict[str, Any] | None:
    threads = 1 if variant == "threads1" else args.threads
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", who, "--round", str(rnd),
           "--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch", str(args.batch), "--group-size", str(args.group_size),
           "--max-new-tokens", str(max_new or args.max_new_tokens), "--threads", str(threads),
           "--lr", str(args.lr), "--beta", str(args.beta), "--seed", str(args.seed),
           "--variant", variant, "--dtype", args.dtype, "--device", args.device]
    # the last round's children count their work and trace their memory, after timing
    cmd.append("--flops" if flops else "--no-flops")
    cmd.append("--memory-trace" if flops and args.memory_trace else "--no-memory-trace")
    if args.fixed_length:
        cmd.append("--fixed-length")
    env = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads)}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    la0 = loadavg()
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                           timeout=(max(1.0, deadline - time.monotonic())
                                    if args.time_limit else None))
        stdout, stderr, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as cut:
        stdout = cut.stdout.decode() if isinstance(cut.stdout, bytes) else (cut.stdout or "")
        stderr, rc = "", "cut at --time-limit"
        print(f"  round {rnd} {who}: cut at the --time-limit", flush=True)
    flops = [int(line[6:]) for line in stdout.splitlines() if line.startswith("FLOPS ")]
    memory = [line[7:] for line in stdout.splitlines() if line.startswith("MEMORY")]
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            if flops:
                res["flops"] = flops[0]
            if memory:  # the traced step's breakdown, or why it failed
                res["memory"] = (json.loads(memory[0]) if memory[0].startswith("{")
                                 else {"error": memory[0]})
            res["load"] = (la0, loadavg())
            res["wall_child"] = time.perf_counter() - t0
            res["variant"], res["max_new"] = variant, max_new or args.max_new_tokens
            print(f"  round {rnd} {who:3s} {variant:10s}: {res['steps'] / res['time']:.4f} steps/s, "
                  f"{res['time'] / res['steps']:.3g} s/step, {memory_label(args)[:-4]} "
                  f"{res['peak_rss_mib']:.0f} MiB, {res['tokens'] / res['steps']:.0f} tok/step, "
                  f"build {res['build_s']:.0f} s, load {la0:.2f}->{res['load'][1]:.2f}, "
                  f"child {res['wall_child']:.0f} s", flush=True)
            return res
    if rc == "cut at --time-limit":
        return None
    sys.stderr.write(stdout[-3000:] + stderr[-6000:])
    raise SystemExit(f"{who} child failed (rc {rc})")


def per_step(rs: list[dict[str, Any]]) -> dict[str, float]:
    """Means per timed step over children: s/step, time split, tokens, peak memory."""
    steps = sum(r["steps"] for r in rs)
    t = sum(r["time"] for r in rs)
    out = {"s": t / steps, "tok": sum(r["tokens"] for r in rs) / steps,
           "peak": max(r["peak_rss_mib"] for r in rs)}
    for k in ("gen", "ref", "pol"):
        out[k] = sum(r["split"][k] for r in rs) / steps
    return out


def memory_label(args: argparse.Namespace) -> str:
    return "peak GPU MiB" if args.device == "cuda" else "peak RSS MiB"


def print_report(args: argparse.Namespace, res: dict[str, list[dict[str, Any]]],
                 rate: float | None, info: dict[str, Any], memory_s: float = 0.0) -> str:
    """The side-by-side table. ``memory_s``: seconds a step needs at least to read what its
    decode reads (GPU: bytes / measured bandwidth), added to each trainer's FLOP floor."""
    from gpu_memory import describe

    lines = []
    agg: dict[str, dict[str, float]] = {}
    for who in ("trl", "lab"):
        rs = res[who]
        steps = sum(r["steps"] for r in rs)
        t = sum(r["time"] for r in rs)
        a = {**per_step(rs), "steps": steps, "t": t, "sps": steps / t,
             "cpu_sps": steps / sum(r["cpu"] for r in rs),
             "width": statistics.mean(r["width"] for r in rs),
             "built": max(r["rss_after_build_mib"] for r in rs)}
        a["other"] = a["s"] - a["gen"] - a["ref"] - a["pol"]
        a["tok_s"] = a["tok"] * steps / t
        a["gen_tok_s"] = a["tok"] / a["gen"] if a["gen"] else float("nan")
        fl = [r["flops"] for r in rs if "flops" in r]
        if fl and rate:
            a["gflop"] = fl[-1] / 1e9
            a["floor"] = fl[-1] / rate + memory_s
        agg[who] = a
    name = {"trl": "TRL GRPOTrainer", "lab": "grpolab"}
    mem = memory_label(args)
    hdr = ("| trainer | steps/s | s/step | gen s | ref s | policy fwd+bwd s | other s | "
           f"tokens/step | tokens/s (step) | tokens/s (gen) | {mem} | GFLOP/step | "
           "floor s/step | x floor |")
    f = ".3f" if args.device == "cuda" else ".1f"  # a GPU's seconds are small
    lines += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for who in ("trl", "lab"):
        a = agg[who]
        floor = (f"{a['gflop']:.0f} | {a['floor']:{f}} | "
                 f"{a['t'] / a['steps'] / a['floor']:.1f}" if "floor" in a else "- | - | -")
        lines.append(f"| {name[who]} | {a['sps']:.4f} | {1 / a['sps']:{f}} | {a['gen']:{f}} | "
                     f"{a['ref']:{f}} | {a['pol']:{f}} | {a['other']:{f}} | {a['tok']:.0f} | "
                     f"{a['tok_s']:.1f} | {a['gen_tok_s']:.1f} | {a['peak']:.0f} | {floor} |")
    lab, trl = agg["lab"], agg["trl"]
    per = [lr["steps"] / lr["time"] / (tr["steps"] / tr["time"])
           for lr, tr in zip(res["lab"], res["trl"])]
    lines += [
        "",
        f"ratio grpolab / TRL: {lab['sps'] / trl['sps']:.2f}x steps/s (per round: "
        + ", ".join(f"{x:.2f}" for x in per) + "); "
        # (on a GPU the host spins in synchronize: CPU time is wall time)
        + (f"{lab['cpu_sps'] / trl['cpu_sps']:.2f}x steps per CPU-second; "
           if args.device != "cuda" else "")
        + f"{lab['gen_tok_s'] / trl['gen_tok_s']:.2f}x generation's tokens/s; "
        f"{mem[:-4]} {lab['peak'] / trl['peak']:.2f}x TRL's",
    ]
    if "floor" in lab and "floor" in trl:
        where = (f"{args.device}" if args.device == "cuda" else f"here at {args.threads} threads")
        plus = (f" + the decode's bytes / the measured bandwidth ({memory_s:.3f} s; added, "
                "no overlap assumed; every row's prompt keys counted)" if memory_s else "")
        lines.append(f"floor: matmul+attention FLOPs of one step (torch.utils.flop_counter) / "
                     f"{rate / 1e9:.0f} GFLOP/s (best {args.dtype} matmul {where}){plus}; TRL does {trl['gflop'] / lab['gflop']:.2f}x grpolab's counted "
                     f"work{'' if args.fixed_length else ' (sampled lengths differ)'}; "
                     f"TRL's measured time / grpolab's floor = "
                     f"{trl['t'] / trl['steps'] / lab['floor']:.2f}x (about the most any "
                     f"trainer doing grpolab's work could reach)")
    loads = ", ".join(f"{r['trainer']}{r['round']} {r['load'][0]:.2f}/{r['load'][1]:.2f}"
                      for rr in zip(res["trl"], res["lab"]) for r in rr)
    lines.append(f"machine: {info['cpu']}, {info['nproc']} CPUs visible, torch threads "
                 f"{args.threads}; {info['versions']}; 1-min load before/after each child: "
                 f"{loads}")
    for who in ("trl", "lab"):
        traced = [r["memory"] for r in res[who] if "memory" in r]
        if traced:
            lines.append(f"memory at the peak: {describe(name[who], traced[-1])}"
                         if "error" not in traced[-1] else
                         f"memory trace of {name[who]} failed: {traced[-1]['error']}")
    if args.device == "cuda":
        held = {who: max(r["reserved_mib"] for r in res[who]) for who in ("trl", "lab")}
        lines.append(f"GPU memory reserved at the peak (allocated + the allocator's cache, "
                     f"CUDA graph pools included): TRL {held['trl']:.0f} MiB, grpolab "
                     f"{held['lab']:.0f} MiB ({held['lab'] / held['trl']:.2f}x TRL's)")
        lines.append("graph decoders built (each capturing its graphs) in grpolab's timed "
                     f"steps: {sum(r.get('graph_builds', 0) for r in res['lab'])} in "
                     f"{sum(r['steps'] for r in res['lab'])} steps (else the kept one replayed)")
        failed = next((r["graph_failed"] for r in res["lab"] if r.get("graph_failed")), None)
        if failed:
            lines.append(f"CUDA GRAPH CAPTURE FAILED ({failed}): grpolab decoded uncaptured")
    lines.append(f"{mem[:-4]} after model load + trainer build (before any step): TRL "
                 f"{trl['built']:.0f} MiB, grpolab {lab['built']:.0f} MiB; trainable params: "
                 f"TRL {res['trl'][0]['trainable']}, grpolab {res['lab'][0]['trainable']}")
    return "\n".join(lines)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each default, except the empty ones ("(default: )" says nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default == "" else super()._get_help_string(action)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=_Help)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="HF model folder, .gguf file or a name grpolab knows")
    p.add_argument("--steps", type=int, default=2, help="timed steps per child")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed steps at the start of a child (0: time from the first step)")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs both trainers")
    p.add_argument("--group-size", type=int, default=8,
                   help="answers per prompt (G); --batch / G prompts per step")
    p.add_argument("--batch", type=int, default=32, help="completions per optimizer step")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="most tokens generated per completion")
    p.add_argument("--threads", type=int, default=2, help="torch threads in every child")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights and matmuls of both trainers (bfloat16: TRL with bf16=True, "
                        "grpolab with dtype bfloat16; LoRA adapters stay float32 in both)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where both trainers run (cuda: TRL with its HF generation, no vLLM; "
                        "peak memory is torch.cuda.max_memory_allocated)")
    p.add_argument("--lr", type=float, default=1e-5,
                   help="learning rate of both trainers (constant, Adam(W), no weight decay)")
    p.add_argument("--beta", type=float, default=0.04,
                   help="KL coefficient to the reference (the model with adapters off)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompts and of both trainers")
    p.add_argument("--flops", action=argparse.BooleanOptionalAction, default=True,
                   help="count one step's FLOPs in the last round and print the floor")
    p.add_argument("--memory-trace", action=argparse.BooleanOptionalAction, default=True,
                   help="cuda: the last round's children run one more step under torch.cuda "
                        "memory history and report what is live at its peak (bench/gpu_memory)")
    p.add_argument("--time-limit", type=float, default=0,
                   help="seconds for all children; a round cut short is dropped (0 = none)")
    p.add_argument("--fixed-length", action="store_true",
                   help="no EOS: every completion runs to --max-new-tokens (equal work)")
    p.add_argument("--levers", default="",
                   help="grpolab only, one child per variant and round, comma-separated: "
                   + ", ".join(LAB_VARIANTS) + "; prints the lever table")
    p.add_argument("--lengths", default="",
                   help="comma-separated completion lengths: peak memory and time of both "
                   "trainers at each (implies --fixed-length); with --levers, grpolab's "
                   "variants too")
    p.add_argument("--ab", default="",
                   help="grpolab only, in one process: steps alternate between the build as "
                   "shipped and each of these levers off (" + ", ".join(AB_SWITCHES)
                   + "); --rounds rounds")
    p.add_argument("--out", default="", help="also write the report (markdown) here")
    p.add_argument("--child", choices=["trl", "lab"], help=argparse.SUPPRESS)
    p.add_argument("--variant", default="full", choices=list(LAB_VARIANTS),
                   help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.batch % a.group_size:
        p.error(f"--batch {a.batch} must be a multiple of --group-size {a.group_size}")
    if a.warmup < 0 or a.steps < 1 or a.rounds < 1:
        p.error("--warmup must be >= 0, --steps and --rounds >= 1")
    a.lever_list = [v.strip() for v in a.levers.split(",") if v.strip()]
    a.ab_list = [v.strip() for v in a.ab.split(",") if v.strip()]
    if [v for v in a.ab_list if v not in AB_SWITCHES]:
        p.error(f"--ab takes {', '.join(AB_SWITCHES)} (got {a.ab!r})")
    bad = [v for v in a.lever_list if v not in LAB_VARIANTS]
    if bad:
        p.error(f"unknown --levers {bad}; choose from {', '.join(LAB_VARIANTS)}")
    try:
        a.length_list = [int(x) for x in a.lengths.split(",") if x.strip()]
    except ValueError:
        p.error(f"--lengths must be comma-separated integers (got {a.lengths!r})")
    if any(x < 1 for x in a.length_list):
        p.error("--lengths must be >= 1")
    if a.length_list:
        a.fixed_length = True
    return a


def lever_report(args: argparse.Namespace, res: dict[str, list[dict[str, Any]]]) -> str:
    """grpolab with one lever changed at a time, against the build as shipped."""
    base = per_step(res["full"]) if res.get("full") else None
    hdr = ("| grpolab variant | what changes | s/step | gen s | ref s | policy fwd+bwd s | "
           f"tokens/step | {memory_label(args)} | time vs shipped | memory vs shipped |")
    lines = [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for v, rs in res.items():
        a = per_step(rs)
        rel = (f"{a['s'] / base['s']:.2f}x | {a['peak'] / base['peak']:.2f}x" if base
               else "- | -")
        lines.append(f"| {v} | {LAB_VARIANTS[v]} | {a['s']:.1f} | {a['gen']:.1f} | "
                     f"{a['ref']:.1f} | {a['pol']:.1f} | {a['tok']:.0f} | {a['peak']:.0f} | "
                     f"{rel} |")
    return "\n".join(lines)


def length_report(args: argparse.Namespace, res: dict[tuple[str, str, int], dict[str, Any]]
                  ) -> str:
    hdr = ("| completion tokens | trainer | s/step | gen s | ref s | policy fwd+bwd s | "
           f"tokens/step | {memory_label(args)} | peak vs TRL |")
    lines = [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for (who, variant, n), r in res.items():
        a = per_step([r])
        trl = res.get(("trl", "full", n))
        name = "TRL GRPOTrainer" if who == "trl" else f"grpolab {variant}"
        vs = f"{a['peak'] / trl['peak_rss_mib']:.2f}x" if trl else "-"
        lines.append(f"| {n} | {name} | {a['s']:.1f} | {a['gen']:.1f} | {a['ref']:.1f} | "
                     f"{a['pol']:.1f} | {a['tok']:.0f} | {a['peak']:.0f} | {vs} |")
    return "\n".join(lines)


# The levers that are speed options: --levers builds the config with the option off, --ab
# switches it on the running backend (its fast forward reads pack and score_pack itself).
SPEED_LEVERS = {"no-pack": "cpu_pack", "no-score-pack": "score_pack",
                "no-eager-head": "head_grad_in_forward", "no-early-exit": "early_exit",
                "no-buckets": "length_buckets", "hf-forward": "lean_forward",
                "no-graph": "graph_decode"}


def _switch_speed(option: str) -> Any:
    def switch(be: Any, on: bool) -> None:
        be.speed = dataclasses.replace(be.speed, **{option: on})
        if be._fast is not None:
            be._fast.pack, be._fast.score_pack = be.speed.cpu_pack, be.speed.score_pack
    return switch


def _switch_chunk(be: Any, on: bool) -> None:
    from grpolab.config import Config

    be.logit_chunk = Config.logit_chunk if on else 0


# --ab: levers that switch at run time (backend, lever on?), so one process can alternate them
AB_SWITCHES = {"no-chunk": _switch_chunk,
               **{k: _switch_speed(v) for k, v in SPEED_LEVERS.items() if v != "lean_forward"}}


def ab_main(args: argparse.Namespace) -> str:
    """One grpolab process; after a warm-up step, steps alternate between the build as shipped
    and each --ab lever off (order flipped every round), so machine drift reaches both alike.
    Time only (one process: no per-variant peak memory)."""
    import torch

    torch.set_num_threads(args.threads)
    split = Split()
    if args.device == "cuda":
        split.sync = torch.cuda.synchronize
    with tempfile.TemporaryDirectory(prefix="vs-trl-real-ab-") as out:
        _, one_step, _ = child_lab(args, args.model, out, split)
        be = one_step.__self__.backend
        one_step()
        split.close_step()
        names = ["full", *args.ab_list]
        got: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for rnd in range(args.rounds):
            for name in (names if rnd % 2 == 0 else names[::-1]):
                for lever in args.ab_list:
                    AB_SWITCHES[lever](be, name != lever)
                t0 = time.perf_counter()
                one_step()
                if split.sync:
                    split.sync()
                split.close_step(total=time.perf_counter() - t0)
                st = split.steps[-1]
                got[name].append({"time": st["total"], **phases("lab", st),
                                  "tok": st.get("tokens", 0.0)})
                print(f"  round {rnd} {name:9s}: {st['total']:.2f} s/step", flush=True)
    mean = {n: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for n, rs in got.items()}
    lines = [("| grpolab, one process | steps | s/step | gen s | ref s | policy fwd+bwd s | "
              "tokens/step | gen ms/token | time vs shipped |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        m = mean[n]
        what = "as shipped" if n == "full" else LAB_VARIANTS[n]
        per_tok = 1e3 * m["gen"] / m["tok"] if m["tok"] else float("nan")
        lines.append(f"| {n}: {what} | {len(got[n])} | {m['time']:.2f} | {m['gen']:.2f} | "
                     f"{m['ref']:.2f} | {m['pol']:.2f} | {m['tok']:.0f} | {per_tok:.1f} | "
                     f"{m['time'] / mean['full']['time']:.2f}x |")
    return "\n".join(lines)


def no_chat_template(model_dir: str) -> str | None:
    """Why ``model_dir`` cannot be benchmarked (its tokenizer has no chat template), or None.
    Both trainers are given chat-templated prompts, and TRL fails without a template."""
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(model_dir).chat_template:
        return None
    return (f"the tokenizer of {model_dir} has no chat template; this benchmark gives both "
            "trainers chat-templated prompts, so it needs one (an instruct model, or "
            "make_tiny_model(..., chat_template=True))")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        return child_main(args)
    from grpolab.rollout.models import resolve_model

    args.model = resolve_model(args.model)
    missing = no_chat_template(args.model)
    if missing:  # refused here in one line, not as a traceback from TRL's child
        print(f"vs_trl_real.py: error: {missing}", file=sys.stderr)
        return 2
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    info = {"cpu": cpu_name(), "nproc": os.cpu_count(), "versions": versions()}
    print(f"model {args.model}\nGRPO: G={args.group_size}, {args.batch} completions/step, max "
          f"{args.max_new_tokens} new tokens{' (no EOS)' if args.fixed_length else ''}, T=1, "
          f"beta={args.beta}, LoRA r=8 alpha 16 on {','.join(TARGETS)}, {args.dtype}, "
          f"{args.threads} threads; {args.rounds} rounds x {args.steps} timed steps "
          f"(+{args.warmup} warm-up) per trainer, one process each; {info['cpu']}", flush=True)
    deadline = time.monotonic() + (args.time_limit or 1e9)
    machine = (f"machine: {info['cpu']}, {info['nproc']} CPUs visible, torch threads "
               f"{args.threads}")
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    if malloc:  # glibc's allocator settings change peak RSS (freed memory kept or returned)
        machine += "; " + ", ".join(f"{k}={v}" for k, v in sorted(malloc.items()))
    if args.ab_list:
        report = ab_main(args) + "\n" + machine
    elif args.length_list:
        got: dict[tuple[str, str, int], dict[str, Any]] = {}
        for n in args.length_list:
            for who, variant in [("trl", "full"), ("lab", "full")] + [
                    ("lab", v) for v in args.lever_list if v != "full"]:
                if time.monotonic() >= deadline:
                    break
                r = run_child(args, who, 0, False, deadline, variant, max_new=n)
                if r is not None:
                    got[(who, variant, n)] = r
        report = length_report(args, got) + "\n" + machine
    elif args.lever_list:
        lev: dict[str, list[dict[str, Any]]] = {v: [] for v in args.lever_list}
        for rnd in range(args.rounds):
            order = args.lever_list if rnd % 2 == 0 else args.lever_list[::-1]
            for v in order:
                if time.monotonic() < deadline:
                    r = run_child(args, "lab", rnd, False, deadline, v)
                    if r is not None:
                        lev[v].append(r)
        lev = {v: rs for v, rs in lev.items() if rs}
        if not lev:
            print("no lever run finished within --time-limit")
            return 1
        report = lever_report(args, lev) + "\n" + machine
    else:
        res: dict[str, list[dict[str, Any]]] = {"trl": [], "lab": []}
        for rnd in range(args.rounds):
            order = ["trl", "lab"] if rnd % 2 == 0 else ["lab", "trl"]
            both = [run_child(args, who, rnd, args.flops and rnd == args.rounds - 1, deadline)
                    for who in order if time.monotonic() < deadline]
            if len(both) < 2 or None in both:  # a round counts only with both trainers in it
                print(f"  round {rnd} incomplete: dropped; stopping", flush=True)
                break
            for who, r in zip(order, both):
                res[who].append(r)
        if not res["trl"]:
            print("no complete round within --time-limit")
            return 1
        rate, memory_s = None, 0.0
        shape = (args.batch * args.max_new_tokens, cfg["hidden_size"], cfg["intermediate_size"],
                 cfg["vocab_size"])
        if args.flops and args.device == "cuda":
            rate, bw = gpu_rates(args.dtype, *shape)
            prompt = statistics.mean(r.get("prompt_len", 40) for r in res["lab"])
            memory_s = decode_bytes(cfg, args.dtype, args.batch, round(prompt),
                                    args.max_new_tokens) / bw
            info["cpu"] += f"; {gpu_name()}: {bw / 1e12:.2f} TB/s copy, {rate / 1e12:.0f} TFLOP/s"
        elif args.flops:
            rate = matmul_rate(args.threads, *shape, args.dtype)
        report = print_report(args, res, rate, info, memory_s)
    print("\n" + report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
